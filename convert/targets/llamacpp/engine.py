"""The real llama.cpp, built by scripts/llamacpp_env.sh into its own virtual environment: where its
python is (`engine_python`), and llama.cpp's own quantizer run there (`quantize`)."""

import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import gguf

from convert.errors import ConvertError, EnvironmentFailure

if TYPE_CHECKING:
    from collections.abc import Sequence

#: The quantized types `quantize` writes, as llama.cpp's `LLAMA_FTYPE_MOSTLY_*` numbers.
QUANTIZED = {"Q8_0": 7, "Q4_K_M": 15}
SCRIPT = "scripts/llamacpp_env.sh"

_QUANTIZE = """
import json, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
overrides = json.loads(sys.argv[4])  # [[regex, ggml type], ...]: llama-quantize's --tensor-type
if overrides:
    table = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()  # ends with a null pattern
    for entry, (pattern, kind) in zip(table, overrides):
        entry.pattern, entry.type = pattern.encode(), kind
    params.tt_overrides = table
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def engine_python() -> Path | None:
    """The engine venv's python ($CONVERT_LLAMACPP_VENV, else .venv-llamacpp at the repository root),
    None when llama-cpp-python is not (yet) installed there."""
    venv = Path(os.environ.get("CONVERT_LLAMACPP_VENV") or Path(__file__).resolve().parents[3] / ".venv-llamacpp")
    built = any(venv.glob("lib/python*/site-packages/llama_cpp/lib"))
    return venv / "bin" / "python" if built else None


def quantize(source: Path, output: Path, kind: str, overrides: "Sequence[tuple[str, str]]" = ()) -> None:
    """Quantize the GGUF `source` (written with half-range scales: `write_gguf(half=True)`) to `kind`
    (`QUANTIZED`) at `output` with llama.cpp's `llama_model_quantize`; `overrides`: (regex over tensor
    names, ggml type name such as "Q6_K") pairs that take precedence over the mix's choice, as
    llama-quantize's `--tensor-type` does."""
    if kind not in QUANTIZED:
        raise ConvertError(f"quantization {kind!r}: llama.cpp's quantizer is used for {', '.join(QUANTIZED)} only")
    python = engine_python()
    if python is None:
        raise EnvironmentFailure(f"quantizing to {kind} runs llama.cpp's own quantizer: build it with {SCRIPT}")
    types = json.dumps([[pattern, int(gguf.GGMLQuantizationType[name])] for pattern, name in overrides])
    run = subprocess.run(
        [str(python), "-c", _QUANTIZE, str(source), str(output), str(QUANTIZED[kind]), types],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise EnvironmentFailure(f"llama_model_quantize failed ({run.returncode}): {run.stderr.strip()[-500:]}")
