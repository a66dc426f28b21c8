#!/usr/bin/env bash
# Every GPU check and benchmark in one run (the device machine is lent for minutes at a time).
#
#   bash benchmarks/gpu_all.sh OUT_DIR
#   GPU_STEPS="triton_tests bench" GPU_TESTS_K="prefill or sliding" bash benchmarks/gpu_all.sh OUT_DIR
#
# Expects: python3 with torch + triton + CUDA; transformers >= 5.24 (wheels in .whl/ are
# installed to /tmp/site when present); SmolLM2's config and tokenizer files (no weights)
# in .gpu/smollm2-shape/. Each step has its own time limit, so one slow step cannot
# starve the rest; logs and JSON land in OUT_DIR.
set -u
out=${1:?usage: gpu_all.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
rm -rf /tmp/smollm2-shape && cp -r .gpu/smollm2-shape /tmp/smollm2-shape

steps=${GPU_STEPS:-triton_tests gpu_attention gpu_paged gpu_check bench core_speed}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    case " $steps " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name (limit ${limit}s)"
    local started=$SECONDS
    local log="$out/$name${LOG_SUFFIX:-}.log"  # LOG_SUFFIX: one log per run of a step that runs more than once
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    tail -n 40 "$log"
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
}

step triton_tests "${GPU_TESTS_LIMIT:-240}" env KVPOLICY_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_backend.py -k "${GPU_TESTS_K:-not nothing}"
step gpu_attention 200 python3 benchmarks/gpu_attention.py --contexts 4096 16384 --batches 1 8 --repeats 3
# the vLLM integration's paged decode (issue #14): in-place kernels against the gather path, Llama-3-8B's heads
step gpu_paged 120 python3 benchmarks/gpu_paged.py --out "$out/gpu_paged.json"
step gpu_check 300 python3 benchmarks/gpu_check.py --config-dir /tmp/smollm2-shape --out "$out/gpu_check.json"
# the bench loads the folder as a model: random weights of SmolLM2's shape (gpu_check.py writes the same)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import torch, gpu_check as g; from pathlib import Path; \
g.DEVICE = torch.device('cuda'); g.random_model(Path('/tmp/smollm2-shape'), torch.bfloat16)" >/dev/null 2>&1
step bench "${GPU_BENCH_LIMIT:-300}" python3 -m kvpolicy.commands.cli bench --model /tmp/smollm2-shape --device cuda \
    --dtype bfloat16 --recipes full h2o streaming --kv-memory 4GiB --prompt-tokens 2048 --new-tokens 64 \
    --max-batch 256 --repeats 3 --out "$out/bench"
# compiled end to end (issue #18): plain transformers eager and compiled (StaticCache + CUDA graphs) against kvpolicy
# h2o 20% eager and compiled (session.compile(mode="reduce-overhead")), SmolLM2 shapes, 4,096 tokens, batch 1 and 8
for batch in 1 8; do
    LOG_SUFFIX=_b$batch step core_speed "${GPU_SPEED_LIMIT:-300}" python3 benchmarks/core_speed.py --model /tmp/smollm2-shape --device cuda \
        --dtype bfloat16 --compile --compile-mode reduce-overhead --contexts 4096 --batch "$batch" --new-tokens 64 \
        --repeats 3 --out "$out/core_speed_b$batch.json"
done
