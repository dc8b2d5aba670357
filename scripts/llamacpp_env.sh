#!/usr/bin/env bash
# Create (idempotently) the llama.cpp venv used by tests/targets/test_target_llamacpp.py
# and bench/llamacpp.py: llama-cpp-python built from the registry's sdist (it vendors
# llama.cpp), CPU only, without the multimodal library, tools or tests. Prints the
# venv's python as the last line.
# Needs cmake >= 3.21 (pip's `cmake` is used when the system's is older), a C++17 compiler.
# Cold build on 2 busy cores under nice -n 19 with one compile job at a time: 37 min (2,235 s)
# (the measured time is in the session report; more jobs: CMAKE_BUILD_PARALLEL_LEVEL=N).
set -euo pipefail
V="${CONVERT_LLAMACPP_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-llamacpp}"
if ! "$V/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
    python3 -m venv "$V"
    "$V/bin/pip" install -q --upgrade pip
    "$V/bin/pip" install -q "scikit-build-core[pyproject]>=0.9.2" cmake ninja numpy
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    PATH="$V/bin:$PATH" nice -n "${CONVERT_LLAMACPP_NICE:-19}" "$V/bin/pip" install -v \
        --no-build-isolation --no-binary llama-cpp-python llama-cpp-python==0.3.36
fi
"$V/bin/python" -c "import numpy" >/dev/null 2>&1 || "$V/bin/pip" install numpy
echo "$V/bin/python"
