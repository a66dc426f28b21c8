#!/usr/bin/env bash
# The vLLM integration on a GPU, in one command (docs/vllm.md, "On CUDA"):
#
#   bash benchmarks/gpu_vllm.sh OUT_DIR [MODEL_DIR]
#
# 1. kvpolicy's paged kernels on CUDA (benchmarks/gpu_paged.py): the score pass against a gather path, the
#    compaction (move_slots) against torch's indexing, checked and timed. Needs torch + triton + CUDA only.
# 2. Where a CUDA build of vLLM is importable: greedy tokens of stock vLLM, `streaming` and `h2o` through vLLM's
#    own FlashAttention/Triton backends (tests/vllm/driver.py; kvpolicy's attention must never run), then the
#    capacity run of docs/vllm.md: 24 requests of ~1,500 prompt tokens and 256 new tokens in 138 blocks of 32,
#    full cache against `h2o` and `streaming` at 20%. MODEL_DIR: a local Hugging Face folder (default: the
#    embedded SmolLM2 as kvpolicy caches it; a folder with config and tokenizer only gets random weights).
set -u
out=${1:?usage: gpu_vllm.sh OUT_DIR [MODEL_DIR]}
model=${2:-${KVPOLICY_CACHE:-$HOME/.cache/kvpolicy}/smollm2-135m-instruct}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$out/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
}

step kernels 180 python3 benchmarks/gpu_paged.py --requests 1 32 --context 2048 8192 --out "$out/gpu_paged.json"

if ! python3 -c "import vllm" 2>/dev/null; then
    echo "=== no vLLM here: the serving steps need a CUDA build of vLLM (pip install vllm, in an environment of its own)"
    exit 0
fi
load=auto
[ -f "$model/model.safetensors" ] || load=dummy  # config and tokenizer only: random weights of the model's shape
python3 - "$model" "$out/jobs.json" "$load" <<'PY'
import json, sys
from transformers import AutoTokenizer
import pydoc_data.topics
model, path, load = sys.argv[1:]
ids = AutoTokenizer.from_pretrained(model)("\n\n".join(pydoc_data.topics.topics.values()))["input_ids"]
prompts = [ids[:760], ids[5000:6001]]
engine = {"dtype": "bfloat16", "load_format": load, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 2048}
jobs = [{"model": model, "config": config, "prompts": prompts, "max_tokens": 64, "engine": engine}
        for config in (None, {"recipe": "streaming"}, {"recipe": "recipes/h2o.yaml"})]
json.dump(jobs, open(path, "w"))
PY
step parity 600 python3 tests/vllm/driver.py "$out/jobs.json"
grep '^RESULT' "$out/parity.log" | python3 -c "
import json, sys
rows = [json.loads(line[7:]) for line in sys.stdin]
for name, row in zip(['stock', 'streaming', 'h2o'], rows):
    print(name, row.get('error') or {'manager': row['manager'], 'calls': row['calls'],
                                     'most blocks held': [max(h for _, h, _ in b) for b in row['blocks']]})
"
step capacity 1800 python3 -m kvpolicy.integrations.vllm.capacity --model "$model" --load-format "$load" \
    --recipes full h2o streaming --requests 24 --prompt-tokens 1500 --new-tokens 256 --kv-blocks 138 \
    --dtype bfloat16 --prefill-chunk 256 --evict-during-prefill --out "$out/capacity"
