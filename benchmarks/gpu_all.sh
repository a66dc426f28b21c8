#!/usr/bin/env bash
# Every GPU check and benchmark in one run (the device machine is lent for minutes at a time).
#
#   bash benchmarks/gpu_all.sh OUT_DIR
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

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
}

step triton_tests 240 env KVPOLICY_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_backend.py
step gpu_attention 200 python3 benchmarks/gpu_attention.py --contexts 4096 16384 --batches 1 8 --repeats 3
step gpu_check 300 python3 benchmarks/gpu_check.py --config-dir /tmp/smollm2-shape --out "$out/gpu_check.json"
if python3 -m kvpolicy.cli bench --help >/dev/null 2>&1; then
    step bench 300 python3 -m kvpolicy.cli bench --model /tmp/smollm2-shape ${KVPOLICY_GPU_BENCH_ARGS:-} --out "$out/bench"
fi
