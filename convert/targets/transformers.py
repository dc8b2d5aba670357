"""The `transformers` target: an exact `DeepseekV3ForCausalLM` checkpoint that stock transformers
loads without custom code (the construction: `convert.targets.deepseek`; docs/serving.md,
"How each export is built"). Built in memory from the whole source, written and verified like a conversion."""

import torch

from convert.arch import AttentionSpec
from convert.hf import load_pretrained
from convert.options import ConvertOptions
from convert.plan import resolve_spec
from convert.targets import Build
from convert.targets.deepseek import (
    check_deepseek,
    export_model,
    export_sizes,
    export_spec,
    exporting,
    to_deepseek_v3,
)

NAME = "transformers"
NOTE = "for stock transformers: exact; its cache holds per-head keys and values, not the latent"
#: What other runtimes make of this output.
FOREIGN = (
    "vLLM would ignore its attention biases and longrope frequencies (another model): for vLLM, convert with "
    "--target vllm"
)


def check(spec: AttentionSpec, opts: ConvertOptions) -> None:
    """What DeepSeek-V3's dense layers cannot hold (q/k norms, fused MLPs)."""
    check_deepseek(spec, NAME)


def build(source, opts: ConvertOptions) -> Build:
    """The export's tensors (made in memory from the whole source) and config; refusals first."""
    spec = resolve_spec(source, source.config, opts)  # the same checks and refusals as the mla target
    check(spec, opts)
    state = {name: source.get(name) for name in source.keys()}
    tensors, config = to_deepseek_v3(state, source.config or {}, spec=spec)
    layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    return Build(
        layout=layout,
        copied=[],
        tensors=exporting(tensors.items(), len(layout), opts.progress),
        config=lambda: config,
        notes=lambda: [f"{NOTE}; {FOREIGN}"],
        sizes=lambda: export_sizes(source, spec, opts, layout, config),
        metadata={"format": "pt"},
        options=opts,
    )


def model(state: dict[str, torch.Tensor], config: dict, opts: ConvertOptions, dtype: torch.dtype, device):
    """`to_mla(target="transformers")`: the export as a DeepseekV3ForCausalLM, in memory."""
    _, _, spec = export_spec(state, config, NAME, opts)  # the same refusals as a conversion
    tensors, export_config = to_deepseek_v3(state, config, spec=spec)
    return export_model(tensors, export_config, dtype, device, NAME)


def load(path, device, dtype):
    """The export as stock transformers loads it."""
    return load_pretrained(path, device, dtype)


def report(export: dict, e2e: dict | None, ckpt_dtype: torch.dtype) -> dict | None:
    """No section of its own: the export is exact, and the end-to-end figures say so."""
    return None
