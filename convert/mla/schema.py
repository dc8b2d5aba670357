"""Checks of a converted directory before anything runs on it (docs/design.md, "Output format").

Its config.json `mla` section against this version's format, the source fields beside it, and the tensors present;
each refusal is a `ConvertError` (exit 2): one line naming the file, the field or tensor, and the fix.
"""

from pathlib import Path

from convert.arch import ARCHS, ArchSpec, AttentionSpec, geometry, tied_embeddings
from convert.arch.spec import count_layers
from convert.arch.validate import check_config, check_field, positive, refuse, string
from convert.errors import ConvertError
from convert.hf import meta_state_dict
from convert.io.gguf import GGUFCheckpoint
from convert.io.locate import CONFIG_NAME, read_json
from convert.io.reader import Checkpoint, open_checkpoint
from convert.mla.config import RECONVERT, LayerEntry, MLASection
from convert.mla.format import MLA_MODEL_TYPE
from convert.mla.shapes import output_shapes

#: What `open_checkpoint` opens: a converted directory's weights are safetensors, or a GGUF file.
Stored = Checkpoint | GGUFCheckpoint


def check_converted(path) -> MLASection | None:
    """Refuse a converted directory whose `mla` section is malformed, from a newer convert, or not
    what its config and tensors say; return the section, typed. A config.json without the section
    is left to the caller (None)."""
    config_path = Path(path) / CONFIG_NAME
    config = read_json(config_path, "config", RECONVERT)
    if not isinstance(config, dict):
        raise ConvertError(f"{config_path} is not a JSON object; {RECONVERT}")
    if "mla" not in config:
        return None
    where = str(config_path)
    mla = MLASection.parse(config["mla"], where)
    source = source_config(config, mla, where)
    check_config(source, where)
    arch = ARCHS[mla.source_architecture]
    _check_against_config(mla, arch, source, where)
    with open_checkpoint(path) as checkpoint:
        _check_against_tensors(mla, arch, config, checkpoint, where)
    return mla


def source_config(config: dict, mla: MLASection, where: str) -> dict:
    """The source model's fields of a converted config.json. Format 1 kept the source's
    model_type; from format 2 on the config's own is `convert_mla` and the source's is in
    `mla.source_model_type` (null for a checkpoint that had no config.json)."""
    fields = {k: v for k, v in config.items() if k != "mla"}
    if mla.format_version < 2:
        return fields
    source_type = mla.source_model_type
    check_field(where, "mla.source_model_type", source_type, lambda v: None if v is None else string(v), RECONVERT)
    own = MLA_MODEL_TYPE if source_type is not None else None
    if fields.get("model_type") != own:
        raise ConvertError(
            f"{where} model_type={fields.get('model_type')!r} but a converted checkpoint of "
            f"mla.source_model_type={source_type!r} has model_type={own!r}; {RECONVERT}"
        )
    if source_type is None:
        fields.pop("model_type", None)
        return fields
    return fields | {"model_type": source_type}


# ------------------------------------------------------------------ the section against config.json


def _even_below(value, bound: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < bound and value % 2 == 0


def _check_against_config(mla: MLASection, arch: ArchSpec, config: dict, where: str) -> None:
    """The section describes the model of the source fields beside it (`source_config`)."""
    for field, want in (("rope", arch.rope), ("causal", arch.causal), ("qk_norm", arch.qk_norm)):
        if getattr(mla, field) != want:
            raise ConvertError(
                f"{where} mla.{field}={getattr(mla, field)!r} but a {arch.name} model has {field}={want!r}; {RECONVERT}"
            )
    if arch.qk_norm is not None:
        check_field(where, "mla.norm_eps", mla.norm_eps, positive, RECONVERT)
    rotary_dim = mla.rotary_dim
    if rotary_dim is not None and (not arch.partial_rotary or not _even_below(rotary_dim, mla.head_dim)):
        problem = (
            "is not a partial RoPE of the model",
            f"absent, or an even number of dims below head_dim={mla.head_dim}",
        )
        raise refuse(where, "mla.rotary_dim", rotary_dim, problem, RECONVERT)
    if bool(mla.norm_unit_offset) != arch.norm_unit_offset:
        raise ConvertError(
            f"{where} mla.norm_unit_offset={mla.norm_unit_offset!r} but a {arch.name} model's q/k norms "
            f"{'scale by 1 + weight' if arch.norm_unit_offset else 'scale by their weight'}; {RECONVERT}"
        )
    if mla.softcap != (config.get("attn_logit_softcapping") if arch.gemma_scores else None):
        raise ConvertError(
            f"{where} mla.softcap={mla.softcap!r} but the model's attn_logit_softcapping is "
            f"{config.get('attn_logit_softcapping')!r}; {RECONVERT}"
        )
    if mla.layer_prefix not in arch.layer_prefixes:
        problem = ("is not a layer prefix of the architecture", f"one of {', '.join(map(repr, arch.layer_prefixes))}")
        raise refuse(where, "mla.layer_prefix", mla.layer_prefix, problem, RECONVERT)
    if arch.hf_attention is None:
        if config.get("model_type") is not None:
            raise ConvertError(
                f"{where} has model_type={config['model_type']!r} but mla.source_architecture='seed'; {RECONVERT}"
            )
        return
    if config.get("model_type") not in arch.model_types:
        raise ConvertError(
            f"{where} model_type={config.get('model_type')!r} but mla.source_architecture={arch.name!r}; {RECONVERT}"
        )
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers"):
        if config.get(field) is None:
            raise ConvertError(f"{where} has no {field}, which the {arch.name} model needs; {RECONVERT}")
    for mla_field, source_field, value in _source_values(config):
        if getattr(mla, mla_field) != value:
            raise ConvertError(
                f"{where} mla.{mla_field}={getattr(mla, mla_field)} but {source_field}={value}: the section does not describe "
                f"this model; {RECONVERT}"
            )


def _source_values(config: dict) -> list[tuple[str, str, int]]:
    """(mla field, config field, value) pairs that must agree, with transformers' defaults."""
    heads = config["num_attention_heads"]
    kv_heads, head_dim = geometry.n_kv_heads(config), geometry.head_dim(config)
    return [
        ("n_layers", "num_hidden_layers", config["num_hidden_layers"]),
        ("hidden_size", "hidden_size", config["hidden_size"]),
        ("n_heads", "num_attention_heads", heads),
        ("n_kv_heads", "num_key_value_heads", kv_heads),
        ("head_dim", "head_dim", head_dim),
    ]


# ------------------------------------------------------------------ the section against the tensors


def _spec(mla: MLASection, arch: ArchSpec) -> AttentionSpec:
    """The attention spec the section describes (for `convert.mla.shapes.output_shapes`)."""
    return AttentionSpec(
        arch=arch,
        n_layers=mla.n_layers,
        n_heads=mla.n_heads,
        n_kv_heads=mla.n_kv_heads,
        head_dim=mla.head_dim,
        hidden_size=mla.hidden_size,
        head_map=mla.head_map,
        rope=mla.has_rope,
        softmax_scale=mla.softmax_scale,
        layer_prefix_template=mla.layer_prefix,
        qk_norm=mla.qk_norm,
        norm_eps=mla.norm_eps,
        rotary_dim=mla.rotary_dim,
    )


def _check_against_tensors(mla: MLASection, arch: ArchSpec, config: dict, checkpoint: Stored, where: str) -> None:
    """Exactly layers 0…n_layers-1, each with the converted tensors its entry describes; the rest of
    the model as transformers builds it."""
    keys = set(checkpoint.keys())
    present = count_layers(arch, mla.layer_prefix, keys)
    if present != mla.n_layers:
        raise ConvertError(
            f"{where} mla.n_layers={mla.n_layers} but {checkpoint.path} holds {present} layers; {RECONVERT}"
        )
    spec = _spec(mla, arch)
    for i, entry in enumerate(mla.layers):
        _check_layer_tensors(spec, i, entry, mla.layout, checkpoint, where)
    if arch.hf_attention is not None:
        attention = tuple(spec.prefix(i) for i in range(spec.n_layers))
        _check_other_tensors(config, checkpoint, attention, where)


def _source_biases(bias: tuple[str, ...]) -> set[str]:
    """Which source biases (q, k, o/v) produce the output biases listed."""
    return {
        p
        for p, names in (("q", ("q_absorbed", "q_proj")), ("k", ("k_down",)), ("o", ("o_absorbed", "o_proj")))
        if set(names) & set(bias)
    }


def _check_layer_tensors(
    spec: AttentionSpec, i: int, entry: LayerEntry, layout: str, checkpoint: Stored, where: str
) -> None:
    """Layer i's converted tensors: the names and shapes its ranks and biases give, floating point."""
    ranks = entry.ranks
    expected = output_shapes(spec, ranks, layout, _source_biases(entry.bias))
    listed = {b + ".bias" for b in entry.bias}
    if {n for n in expected if n.endswith(".bias")} != listed:
        raise ConvertError(
            f"{where} mla.layers[{i}].bias={sorted(entry.bias)} is not a set of biases convert writes; {RECONVERT}"
        )
    prefix = spec.prefix(i)
    actual = {k: checkpoint.shape(k) for k in checkpoint.keys() if k.startswith(prefix)}
    owner = f"{where} mla.layers[{i}] ({', '.join(f'{k}={v}' for k, v in ranks.items())})"
    _compare_tensors(checkpoint, {prefix + n: s for n, s in expected.items()}, actual, owner)


def _compare_tensors(checkpoint: Stored, expected: dict, actual: dict, owner: str, extra_ok=frozenset()) -> None:
    """Tensors present (name -> shape) against those `owner` describes: none missing, none unknown
    (but `extra_ok`), the same shapes, floating point."""
    missing = sorted(expected.keys() - actual.keys())
    if missing:
        raise ConvertError(f"{checkpoint.path}: tensor {missing[0]} is missing but {owner} needs it; {RECONVERT}")
    unknown = sorted(actual.keys() - expected.keys() - extra_ok)
    if unknown:
        raise ConvertError(f"{checkpoint.path}: tensor {unknown[0]!r} is not part of {owner}; remove it or {RECONVERT}")
    for tensor, shape in expected.items():
        if actual[tensor] != shape:
            raise ConvertError(
                f"{checkpoint.path}: tensor {tensor} has shape {list(actual[tensor])} but {owner} gives "
                f"{list(shape)}; {RECONVERT}"
            )
    for tensor in actual:
        _check_floating(checkpoint, tensor)


def _check_floating(checkpoint: Stored, name: str) -> None:
    dtype = checkpoint.dtype(name)
    if not dtype.is_floating_point:
        raise ConvertError(
            f"{checkpoint.path}: tensor {name} is stored as {str(dtype).removeprefix('torch.')}, but weights are "
            f"floating point: its header is damaged; {RECONVERT}"
        )


def _check_other_tensors(config: dict, checkpoint: Stored, attention: tuple[str, ...], where: str) -> None:
    """Every tensor outside the attention, against the model transformers builds from config.json."""
    model = {n: tuple(t.shape) for n, t in _meta_state_dict(config, where).items() if not n.startswith(attention)}
    actual = {n: checkpoint.shape(n) for n in checkpoint.keys() if not n.startswith(attention)}
    tied = {"lm_head.weight"} if tied_embeddings(config) else set()
    _compare_tensors(checkpoint, model, actual, f"the model of {where}", tied)


def _meta_state_dict(config: dict, where: str) -> dict:
    """The model's tensors as transformers builds them (meta device), or a one-line refusal."""
    try:
        return meta_state_dict(config)
    except Exception as exc:  # transformers refuses a config with many exception types: all become one line
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConvertError(
            f"{where}: transformers cannot build the model it describes ({reason}); {RECONVERT}"
        ) from None
