"""DeepSeek-V3 checkpoints built from the source GQA weights: the exact export for stock transformers
(target `transformers`) and what it shares with the vllm target (docs/design.md, "Deployment targets")."""

from convert.targets.deepseek.export import (
    SUPPORTED_ARCHS,
    as_dtype,
    check_deepseek,
    check_exportable,
    deepseek_config_fields,
    export_model,
    export_sizes,
    export_spec,
    exporting,
    pass_through_names,
    to_deepseek_v3,
)
from convert.targets.deepseek.rope import SourceRope, source_rope
from convert.targets.deepseek.tensors import DeepseekGeometry, attention_tensors, interleave_rows, square_width

__all__ = [
    "SUPPORTED_ARCHS",
    "DeepseekGeometry",
    "SourceRope",
    "as_dtype",
    "attention_tensors",
    "check_deepseek",
    "check_exportable",
    "deepseek_config_fields",
    "export_model",
    "export_sizes",
    "export_spec",
    "exporting",
    "interleave_rows",
    "pass_through_names",
    "source_rope",
    "square_width",
    "to_deepseek_v3",
]
