"""Checks of a converted directory before anything runs on it (docs/design.md, "Output format").

Its config.json `mla` section against this version's format, the source fields beside it, and the tensors present;
each refusal is a `ConvertError` (exit 2): one line naming the file, the field or tensor, and the fix.
"""

from pathlib import Path
from typing import Any

from convert.arch import ARCHS, ArchSpec, AttentionSpec
from convert.arch.registry import HEAD_MAPS
from convert.arch.spec import count_layers
from convert.arch.validate import check_config, check_field, count, flag, one_of, positive, refuse, string
from convert.errors import ConvertError
from convert.hf import meta_state_dict
from convert.io.locate import CONFIG_NAME, read_json
from convert.io.reader import Checkpoint, open_checkpoint
from convert.mla.format import FORMAT_VERSION, MLA_MODEL_TYPE
from convert.mla.shapes import output_shapes
from convert.options import LATENTS, LAYOUTS

RECONVERT = "re-convert with `convert gqa2mla`"

#: The section's fields every format-1 directory has, with their checkers.
SECTION_FIELDS = {
    "converter": string,
    "source_architecture": one_of(tuple(ARCHS)),
    "layout": one_of(LAYOUTS),
    "latent": one_of(LATENTS),
    "head_map": one_of(HEAD_MAPS),
    "n_layers": count,
    "hidden_size": count,
    "n_heads": count,
    "n_kv_heads": count,
    "head_dim": count,
    "softmax_scale": positive,
    "causal": flag,
    "layer_prefix": string,
}
#: Output tensors that may carry a bias, by layout (`convert.transform`; q_proj in the absorbed
#: layout of a q/k-norm model, whose query is normalised live).
BIASED = {"absorbed": ("k_down", "q_absorbed", "q_proj", "o_absorbed"), "factored": ("k_down", "q_proj", "o_proj")}


def format_version() -> int:
    """The format this version writes (and so the newest it reads)."""
    return FORMAT_VERSION


def check_converted(path) -> None:
    """Refuse a converted directory whose `mla` section is malformed, from a newer convert, or not
    what its config and tensors say. A config.json without the section is left to the caller."""
    config_path = Path(path) / CONFIG_NAME
    config = read_json(config_path, "config", RECONVERT)
    if not isinstance(config, dict):
        raise ConvertError(f"{config_path} is not a JSON object; {RECONVERT}")
    if "mla" not in config:
        return
    where, mla = str(config_path), config["mla"]
    check_section(mla, where)
    source = source_config(config, mla, where)
    check_config(source, where)
    arch = ARCHS[mla["source_architecture"]]
    _check_against_config(mla, arch, source, where)
    check_layer_entries(mla, where)
    with open_checkpoint(path) as checkpoint:
        _check_against_tensors(mla, arch, config, checkpoint, where)


def source_config(config: dict, mla: dict, where: str) -> dict:
    """The source model's fields of a converted config.json. Format 1 kept the source's
    model_type; from format 2 on the config's own is `convert_mla` and the source's is in
    `mla.source_model_type` (null for a checkpoint that had no config.json)."""
    fields = {k: v for k, v in config.items() if k != "mla"}
    if mla["format_version"] < 2:
        return fields
    source_type = mla.get("source_model_type")
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


# ------------------------------------------------------------------ the section alone


def check_section(mla: Any, where: str) -> None:
    """Types and known values of the `mla` section, and its format version."""
    if not isinstance(mla, dict):
        raise refuse(where, "mla", mla, ("is not an object", "the section `convert gqa2mla` writes"), RECONVERT)
    _check_format_version(mla, where)
    for field, checker in SECTION_FIELDS.items():
        if field not in mla:
            raise ConvertError(f"{where} mla has no {field!r}; {RECONVERT}")
        check_field(where, f"mla.{field}", mla[field], checker, RECONVERT)
    if mla["n_heads"] % mla["n_kv_heads"]:
        raise ConvertError(
            f"{where} mla.n_heads={mla['n_heads']} is not divisible by mla.n_kv_heads={mla['n_kv_heads']}; {RECONVERT}"
        )
    if mla.get("rope") is not None and mla["latent"] == "joint":
        raise ConvertError(
            f"{where} mla.latent='joint' with RoPE keys is a combination convert never writes; {RECONVERT}"
        )
    _check_descriptive(mla, where)


def check_layer_entries(mla: dict, where: str) -> None:
    """`mla.layers`: one well-formed entry per layer."""
    layers = mla.get("layers")
    if not isinstance(layers, list):
        raise refuse(where, "mla.layers", layers, ("is not a list", "one entry per layer"), RECONVERT)
    if len(layers) != mla["n_layers"]:
        raise ConvertError(
            f"{where} mla.layers has {len(layers)} entries but mla.n_layers={mla['n_layers']}; {RECONVERT}"
        )
    for i, entry in enumerate(layers):
        _check_layer_entry(entry, i, mla, where)


def _check_format_version(mla: dict, where: str) -> None:
    """A format this version reads: the one it writes or an older one (1…); a newer one needs a newer convert."""
    version, current = mla.get("format_version"), format_version()
    check_field(where, "mla.format_version", version, count, RECONVERT)
    if version > current:
        raise ConvertError(
            f"{where} mla.format_version={version}: written by a newer convert (this one reads formats 1 to "
            f"{current}); upgrade convert"
        )


def _check_descriptive(mla: dict, where: str) -> None:
    """The fields only reports read: notes (strings), compression (an object or null)."""
    notes = mla.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise refuse(where, "mla.notes", notes, ("is not a list of strings", "a list of strings"), RECONVERT)
    compression = mla.get("compression")
    if compression is not None and not isinstance(compression, dict):
        raise refuse(where, "mla.compression", compression, ("is not an object", "an object or null"), RECONVERT)


def _rank_names(mla: dict) -> tuple[str, ...]:
    return ("rank_kv",) if mla["latent"] == "joint" else ("rank_k", "rank_v")


def _check_layer_entry(entry: Any, i: int, mla: dict, where: str) -> None:
    """One `mla.layers[i]`: its ranks, RoPE frequencies, biases and figures."""
    field = f"mla.layers[{i}]"
    if not isinstance(entry, dict):
        raise refuse(where, field, entry, ("is not an object", "the layer entry convert writes"), RECONVERT)
    ranks = _rank_names(mla)
    extra = sorted(k for k in entry if k.startswith("rank") and k not in ranks)
    if extra:
        raise ConvertError(f"{where} {field} has {extra[0]!r}, not a rank of a {mla['latent']} latent; {RECONVERT}")
    for rank in ranks:
        if rank not in entry:
            raise ConvertError(f"{where} {field} has no {rank!r}; {RECONVERT}")
        check_field(where, f"{field}.{rank}", entry[rank], count, RECONVERT)
    _check_freq_index(entry, field, mla, where)
    bias = entry.get("bias", [])
    if not isinstance(bias, list) or not all(b in BIASED[mla["layout"]] for b in bias) or len(set(bias)) != len(bias):
        problem = ("is not a list of biased tensors", f"a list drawn from {', '.join(BIASED[mla['layout']])}")
        raise refuse(where, f"{field}.bias", bias, problem, RECONVERT)
    for figures in ("retained_energy", "factor_error"):
        _check_figures(entry.get(figures), f"{field}.{figures}", where)


def _check_freq_index(entry: dict, field: str, mla: dict, where: str) -> None:
    """key_freq_index: with RoPE in the absorbed layout, the source frequency (< head_dim/2) of
    each of the r_K/2 latent pairs; absent otherwise."""
    freq = entry.get("key_freq_index")
    if mla.get("rope") is None or mla["layout"] != "absorbed":
        if freq is not None:
            raise ConvertError(
                f"{where} {field}.key_freq_index is set but only absorbed RoPE latents have one; {RECONVERT}"
            )
        return
    rank_k, partial = entry["rank_k"], mla.get("rotary_dim")
    half = (partial or mla["head_dim"]) // 2
    static = (mla.get("compression") or {}).get("static_freqs")
    if partial is None and not static and rank_k % 2:
        raise refuse(where, f"{field}.rank_k", rank_k, ("is odd", "an even rank (RoPE pairs)"), RECONVERT)
    # partial RoPE, or static frequencies cached as NoPE (compression): the latent is
    # [rotated pairs | NoPE dims], so its pairs take at most rank_k dims
    fits = isinstance(freq, list) and (2 * len(freq) <= rank_k if partial or static else len(freq) == rank_k // 2)
    if not fits or any(isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < half for j in freq):
        count = f"at most rank_k/2={rank_k // 2}" if partial else f"rank_k/2={rank_k // 2}"
        want = f"a list of {count} frequency indices below {'rotary_dim' if partial else 'head_dim'}/2={half}"
        raise refuse(where, f"{field}.key_freq_index", freq, ("does not fit the latent", want), RECONVERT)


def _check_figures(figures: Any, field: str, where: str) -> None:
    """retained_energy / factor_error: null or {"k": number, …} (the report prints them)."""
    if figures is None:
        return
    ok = isinstance(figures, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 for v in figures.values()
    )
    if not ok:
        raise refuse(where, field, figures, ("is not a map of numbers", 'null or {"k": 1.0, "v": 1.0}'), RECONVERT)


# ------------------------------------------------------------------ the section against config.json


def _even_below(value, bound: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < bound and value % 2 == 0


def _check_against_config(mla: dict, arch: ArchSpec, config: dict, where: str) -> None:
    """The section describes the model of the source fields beside it (`source_config`)."""
    for field, want in (("rope", arch.rope), ("causal", arch.causal), ("qk_norm", arch.qk_norm)):
        if mla.get(field) != want:
            raise ConvertError(
                f"{where} mla.{field}={mla.get(field)!r} but a {arch.name} model has {field}={want!r}; {RECONVERT}"
            )
    if arch.qk_norm is not None:
        check_field(where, "mla.norm_eps", mla.get("norm_eps"), positive, RECONVERT)
    rotary_dim = mla.get("rotary_dim")
    if rotary_dim is not None and (not arch.partial_rotary or not _even_below(rotary_dim, mla["head_dim"])):
        problem = (
            "is not a partial RoPE of the model",
            f"absent, or an even number of dims below head_dim={mla['head_dim']}",
        )
        raise refuse(where, "mla.rotary_dim", rotary_dim, problem, RECONVERT)
    if bool(mla.get("norm_unit_offset")) != arch.norm_unit_offset:
        raise ConvertError(
            f"{where} mla.norm_unit_offset={mla.get('norm_unit_offset')!r} but a {arch.name} model's q/k norms "
            f"{'scale by 1 + weight' if arch.norm_unit_offset else 'scale by their weight'}; {RECONVERT}"
        )
    if mla.get("softcap") != (config.get("attn_logit_softcapping") if arch.gemma_scores else None):
        raise ConvertError(
            f"{where} mla.softcap={mla.get('softcap')!r} but the model's attn_logit_softcapping is "
            f"{config.get('attn_logit_softcapping')!r}; {RECONVERT}"
        )
    if mla["layer_prefix"] not in arch.layer_prefixes:
        problem = ("is not a layer prefix of the architecture", f"one of {', '.join(map(repr, arch.layer_prefixes))}")
        raise refuse(where, "mla.layer_prefix", mla["layer_prefix"], problem, RECONVERT)
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
        if mla[mla_field] != value:
            raise ConvertError(
                f"{where} mla.{mla_field}={mla[mla_field]} but {source_field}={value}: the section does not describe "
                f"this model; {RECONVERT}"
            )


def _source_values(config: dict) -> list[tuple[str, str, int]]:
    """(mla field, config field, value) pairs that must agree, with transformers' defaults."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return [
        ("n_layers", "num_hidden_layers", config["num_hidden_layers"]),
        ("hidden_size", "hidden_size", config["hidden_size"]),
        ("n_heads", "num_attention_heads", heads),
        ("n_kv_heads", "num_key_value_heads", kv_heads),
        ("head_dim", "head_dim", head_dim),
    ]


# ------------------------------------------------------------------ the section against the tensors


def _spec(mla: dict, arch: ArchSpec) -> AttentionSpec:
    """The attention spec the section describes (for `convert.mla.shapes.output_shapes`)."""
    return AttentionSpec(
        arch=arch,
        n_layers=mla["n_layers"],
        n_heads=mla["n_heads"],
        n_kv_heads=mla["n_kv_heads"],
        head_dim=mla["head_dim"],
        hidden_size=mla["hidden_size"],
        head_map=mla["head_map"],
        rope=mla["rope"] is not None,
        softmax_scale=mla["softmax_scale"],
        layer_prefix_template=mla["layer_prefix"],
        qk_norm=mla.get("qk_norm"),
        norm_eps=mla.get("norm_eps"),
        rotary_dim=mla.get("rotary_dim"),
    )


def _check_against_tensors(mla: dict, arch: ArchSpec, config: dict, checkpoint: Checkpoint, where: str) -> None:
    """Exactly layers 0…n_layers-1, each with the converted tensors its entry describes; the rest of
    the model as transformers builds it."""
    keys = set(checkpoint.keys())
    present = count_layers(arch, mla["layer_prefix"], keys)
    if present != mla["n_layers"]:
        raise ConvertError(
            f"{where} mla.n_layers={mla['n_layers']} but {checkpoint.path} holds {present} layers; {RECONVERT}"
        )
    spec = _spec(mla, arch)
    for i, entry in enumerate(mla["layers"]):
        _check_layer_tensors(spec, i, entry, mla["layout"], checkpoint, where)
    if arch.hf_attention is not None:
        attention = tuple(spec.prefix(i) for i in range(spec.n_layers))
        _check_other_tensors(config, checkpoint, attention, where)


def _source_biases(bias: list[str]) -> set[str]:
    """Which source biases (q, k, o/v) produce the output biases listed."""
    return {
        p
        for p, names in (("q", ("q_absorbed", "q_proj")), ("k", ("k_down",)), ("o", ("o_absorbed", "o_proj")))
        if set(names) & set(bias)
    }


def _check_layer_tensors(
    spec: AttentionSpec, i: int, entry: dict, layout: str, checkpoint: Checkpoint, where: str
) -> None:
    """Layer i's converted tensors: the names and shapes its ranks and biases give, floating point."""
    ranks = {k: v for k, v in entry.items() if k.startswith("rank")}
    expected = output_shapes(spec, ranks, layout, _source_biases(entry.get("bias", [])))
    listed = {b + ".bias" for b in entry.get("bias", [])}
    if {n for n in expected if n.endswith(".bias")} != listed:
        raise ConvertError(
            f"{where} mla.layers[{i}].bias={sorted(entry.get('bias', []))} is not a set of biases convert "
            f"writes; {RECONVERT}"
        )
    prefix = spec.prefix(i)
    actual = {k: checkpoint.shape(k) for k in checkpoint.keys() if k.startswith(prefix)}
    owner = f"{where} mla.layers[{i}] ({', '.join(f'{k}={v}' for k, v in ranks.items())})"
    _compare_tensors(checkpoint, {prefix + n: s for n, s in expected.items()}, actual, owner)


def _compare_tensors(checkpoint: Checkpoint, expected: dict, actual: dict, owner: str, extra_ok=frozenset()) -> None:
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


def _check_floating(checkpoint: Checkpoint, name: str) -> None:
    dtype = checkpoint.dtype(name)
    if not dtype.is_floating_point:
        raise ConvertError(
            f"{checkpoint.path}: tensor {name} is stored as {str(dtype).removeprefix('torch.')}, but weights are "
            f"floating point: its header is damaged; {RECONVERT}"
        )


def _check_other_tensors(config: dict, checkpoint: Checkpoint, attention: tuple[str, ...], where: str) -> None:
    """Every tensor outside the attention, against the model transformers builds from config.json."""
    model = {n: tuple(t.shape) for n, t in _meta_state_dict(config, where).items() if not n.startswith(attention)}
    actual = {n: checkpoint.shape(n) for n in checkpoint.keys() if not n.startswith(attention)}
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
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
