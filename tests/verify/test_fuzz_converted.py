"""Fuzzing converted directories: `convert verify` on a damaged copy of a converted directory
(its config, headers, tensors, index or shards) never PASSes: exit 2 (refused) or exit 1 (FAIL)
(tests/fuzzing.py)."""

import json
import os
import shutil
import struct
from pathlib import Path

import fuzzing
import pytest
import torch
from fuzzing import DROP, Case, Tally, dump, invoke, outcome, pack, read_json, set_config, write_json

from conftest import TINY_LLAMA

N_VERIFY = 50  # at least this many cases

one_thread = fuzzing.one_thread  # autouse: the cases run on one torch thread
converted = fuzzing.converted  # the converted tiny Llama every damage starts from


def _index(d: Path) -> dict:
    return read_json(d / "model.safetensors.index.json")


def _shard_of(d: Path, tensor: str) -> Path:
    return d / _index(d)["weight_map"][tensor]


def _edit_header(tensor: str, fn):
    """Edit one tensor's entry in its shard's header (the data stays where it is)."""

    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        fn(header)
        shard.write_bytes(pack(dump(header), raw[8 + n :]))

    return damage


def _rename(tensor: str, new: str, index_too: bool = True):
    def edit(header):
        header[new] = header.pop(tensor)

    def damage(d: Path) -> None:
        _edit_header(tensor, edit)(d)
        if index_too:
            index = _index(d)
            index["weight_map"][new] = index["weight_map"].pop(tensor)
            write_json(d / "model.safetensors.index.json", index)

    return damage


def _tensors_of(shard: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(shard)


def _save_shard(shard: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(shard), metadata={"format": "pt"})


def _perturb(tensor: str, fn):
    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        tensors = _tensors_of(shard)
        tensors[tensor] = fn(tensors[tensor].clone())
        _save_shard(shard, tensors)

    return damage


def _remove(tensor: str, index_too: bool = True, shard_too: bool = True):
    def damage(d: Path) -> None:
        shard = _shard_of(d, tensor)
        if shard_too:
            tensors = _tensors_of(shard)
            del tensors[tensor]
            _save_shard(shard, tensors)
        if index_too:
            index = _index(d)
            del index["weight_map"][tensor]
            write_json(d / "model.safetensors.index.json", index)

    return damage


def _add(tensor: str, value):
    def damage(d: Path) -> None:
        index = _index(d)
        shard_name = sorted(set(index["weight_map"].values()))[-1]
        tensors = _tensors_of(d / shard_name)
        tensors[tensor] = value
        _save_shard(d / shard_name, tensors)
        index["weight_map"][tensor] = shard_name
        write_json(d / "model.safetensors.index.json", index)

    return damage


def _set_index(fn):
    def damage(d: Path) -> None:
        index = _index(d)
        fn(index)
        write_json(d / "model.safetensors.index.json", index)

    return damage


def _write_file(name: str, data: bytes | None):
    def damage(d: Path) -> None:
        if data is None:
            (d / name).unlink()
        else:
            (d / name).write_bytes(data)

    return damage


def _map_to(tensor: str, shard):
    def edit(index):
        shards = sorted(set(index["weight_map"].values()))
        here = index["weight_map"][tensor]
        index["weight_map"][tensor] = shard if shard is not None else next(s for s in shards if s != here)

    return _set_index(edit)


ATTN0 = "model.layers.0.self_attn."
ATTN1 = "model.layers.1.self_attn."


def _row_plus_one(t):
    t[0] += 1.0
    return t


def verify_cases(converted: Path) -> list[Case]:
    """Damaged copies of one converted directory; each must fail verification or be refused."""
    config = read_json(converted / "config.json")
    version = config["mla"]["format_version"]
    own_type = config["model_type"]  # `convert_mla` from format 2 on, the source's before
    cases = []

    def add(kind, expect, what, damage):
        cases.append(Case(kind, expect, what, damage))

    # the mla section's own fields
    for field, values in {
        "format_version": [version + 1, 99, 0, -1, str(version), None, 1.5, True],
        "n_layers": [1, 3, 0, "2", None, 2.0],
        "n_heads": [8, 2, "4"],
        "n_kv_heads": [1, 4, 3],
        "head_dim": [8, 32],
        "hidden_size": [32, 65],
        "layout": ["foo", 3, "factored"],
        "latent": ["joint", "foo"],
        "head_map": ["foo", None],
        "source_architecture": ["mistral", "qwen2", "seed", "gpt2", None],
        "rope": [None, "interleaved"],
        "causal": [False, "yes"],
        "layer_prefix": ["layers.{i}.", "model.layers.{x}.", "model.layers.{i}.self_attn", 3, "{0}{1}"],
        "softmax_scale": [0, -0.25, "0.25", None, float("nan")],
        "notes": ["x", [1]],
        "compression": ["x", [1]],
        "layers": [[], "x", None],
        "converter": [None, 3],
    }.items():
        for value in values:
            add("mla-field", "refuse", f"mla.{field}={value!r}", set_config("mla", field, value))
    if version >= 2:
        for value in ["qwen3", "mistral", 3, None]:
            add(
                "mla-field", "refuse", f"mla.source_model_type={value!r}", set_config("mla", "source_model_type", value)
            )
        if version > 2 or own_type is not None:
            add("mla-field", "refuse", "mla.format_version=1 (older)", set_config("mla", "format_version", 1))
    for value in ["x", [], None, {}]:
        add("mla-field", "refuse", f"mla={value!r}", set_config("mla", value))
    add("mla-field", "refuse", "mla removed", set_config("mla", DROP))
    for value in [0.5, 0.125]:
        add("mla-field", "fail", f"mla.softmax_scale={value}", set_config("mla", "softmax_scale", value))

    # one layer entry
    for field, value in [
        ("rank_k", 16),
        ("rank_k", 33),
        ("rank_k", 0),
        ("rank_k", "32"),
        ("rank_v", 16),
        ("rank_v", None),
        ("rank_kv", 32),
        ("rank_v", DROP),
        ("key_freq_index", list(range(8))),
        ("key_freq_index", None),
        ("key_freq_index", [8] * 16),
        ("key_freq_index", [-1] * 16),
        ("key_freq_index", ["0"] * 16),
        ("bias", ["q_absorbed"]),
        ("bias", ["k_down"]),
        ("bias", "x"),
        ("bias", ["q_proj"]),
        ("retained_energy", "x"),
        ("retained_energy", {"k": "1"}),
        ("factor_error", [1]),
    ]:
        add("mla-layer", "refuse", f"layers[1].{field}={value!r}", set_config("mla", "layers", 1, field, value))
    add("mla-layer", "refuse", "layers[0]='x'", set_config("mla", "layers", 0, "x"))
    add("mla-layer", "refuse", "last layer entry dropped", set_config("mla", "layers", 1, DROP))
    freq = config["mla"]["layers"][0]["key_freq_index"]
    add("mla-layer", "fail", "key_freq_index reversed", set_config("mla", "layers", 0, "key_freq_index", freq[::-1]))

    # the source fields beside the section
    for field, value in [
        ("num_attention_heads", "4"),
        ("num_attention_heads", 0),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("num_hidden_layers", 1),
        ("num_hidden_layers", 3),
        ("vocab_size", 64),
        ("vocab_size", "128"),
        ("vocab_size", None),
        ("hidden_size", 32),
        ("intermediate_size", 95),
        ("rope_parameters", "x"),
        ("rope_parameters", {"rope_type": "foo"}),
        ("rms_norm_eps", "x"),
        ("rms_norm_eps", -1.0),
        ("hidden_act", "bogus"),
        ("tie_word_embeddings", "yes"),
        ("layer_types", ["full_attention"]),
        ("model_type", "qwen3"),
    ] + ([("model_type", "llama")] if own_type != "llama" else []):
        add("config-field", "refuse", f"{field}={value!r}", set_config(field, value))
    add("config-field", "refuse", "vocab_size removed", set_config("vocab_size", DROP))
    text = (converted / "config.json").read_bytes().rstrip()
    for what, data in [
        ("invalid JSON", text[:-2]),
        ("not an object", b"[" + text + b"]"),
        ("duplicate key", text[:-1] + b', "vocab_size": 64}'),
        ("deep nesting", text[:-1] + b', "x": ' + b"[" * 50000 + b"]" * 50000 + b"}"),
        ("empty", b""),
        ("invalid UTF-8", text.replace(b'"silu"', b'"si\xfflu"')),
        ("removed", None),
    ]:
        add("config-file", "refuse", what, _write_file("config.json", data))

    # tensors
    for tensor in [
        ATTN0 + "k_down.weight",
        ATTN1 + "o_absorbed.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        add("tensor-removed", "refuse", tensor, _remove(tensor))
    add("tensor-removed", "refuse", "index entry only", _remove(ATTN0 + "q_absorbed.weight", shard_too=False))
    for tensor, new in [
        (ATTN0 + "v_down.weight", ATTN0 + "v_proj.weight"),
        ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight"),
        (ATTN1 + "q_absorbed.weight", "model.layers.2.self_attn.q_absorbed.weight"),
    ]:
        add("tensor-renamed", "refuse", f"{tensor} -> {new}", _rename(tensor, new))
    add(
        "tensor-renamed",
        "refuse",
        "shard only",
        _rename(ATTN1 + "k_down.weight", ATTN1 + "k_up.weight", index_too=False),
    )
    for tensor in [
        ATTN0 + "k_down.weight",
        "model.embed_tokens.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]:

        def reshape(header, tensor=tensor):
            dims = header[tensor]["shape"]
            header[tensor]["shape"] = dims[::-1] if len(dims) > 1 else [8, dims[0] // 8]

        add("tensor-reshaped", "refuse", tensor, _edit_header(tensor, reshape))
    for tensor in [ATTN1 + "q_absorbed.weight", "model.layers.0.mlp.down_proj.weight"]:
        add(
            "dtype-relabel",
            "refuse",
            f"{tensor} F32->I32",
            _edit_header(tensor, lambda h, t=tensor: h[t].update(dtype="I32")),
        )
    for tensor, fn in [
        (ATTN0 + "k_down.weight", _row_plus_one),
        (ATTN1 + "v_down.weight", lambda t: t * 1.5),
        (ATTN0 + "q_absorbed.weight", lambda t: t.flip(0)),
        (ATTN1 + "o_absorbed.weight", lambda t: t * 0),
        ("model.embed_tokens.weight", lambda t: t + 0.5),  # every row: verify samples only some token ids
        ("model.layers.0.mlp.down_proj.weight", lambda t: t * 1.5),
        ("model.layers.1.input_layernorm.weight", lambda t: t + 0.5),
        ("lm_head.weight", lambda t: t.flip(0)),
        (ATTN0 + "v_down.weight", lambda t: t.fill_(float("nan"))),
    ]:
        add("tensor-perturbed", "fail", tensor, _perturb(tensor, fn))
    for tensor, shape in [
        (ATTN0 + "q_proj.weight", (64, 64)),
        ("model.layers.2.mlp.up_proj.weight", (96, 64)),
        ("extra.weight", (4,)),
    ]:
        add("tensor-added", "refuse", tensor, _add(tensor, torch.zeros(shape)))

    # the shard index and the shard files
    index_text = (converted / "model.safetensors.index.json").read_bytes()
    first_shard = sorted(set(_index(converted)["weight_map"].values()))[0]
    add("index", "refuse", "invalid JSON", _write_file("model.safetensors.index.json", index_text[:-3]))
    add("index", "refuse", "weight_map missing", _set_index(lambda i: i.pop("weight_map")))
    add("index", "refuse", "weight_map a list", _set_index(lambda i: i.update(weight_map=[])))
    add("index", "refuse", "a value not a string", _set_index(lambda i: i["weight_map"].update({"lm_head.weight": 3})))
    add("index", "refuse", "tensor mapped to another shard", _map_to("model.norm.weight", None))
    add(
        "index",
        "refuse",
        "tensor mapped to a missing shard",
        _map_to("model.norm.weight", "model-00009-of-00009.safetensors"),
    )
    add("index", "refuse", "tensor mapped outside the directory", _map_to("model.norm.weight", "../model.safetensors"))
    add(
        "index",
        "refuse",
        "lists a tensor no shard has",
        _set_index(lambda i: i["weight_map"].update({"ghost.weight": first_shard})),
    )
    add("index", "refuse", "index removed", _write_file("model.safetensors.index.json", None))
    add("shard", "refuse", "a shard removed", _write_file(first_shard, None))
    shard_bytes = (converted / first_shard).read_bytes()
    add("shard", "refuse", "a shard truncated", _write_file(first_shard, shard_bytes[:-100]))
    add("shard", "refuse", "a shard with trailing bytes", _write_file(first_shard, shard_bytes + b"\0" * 8))
    add(
        "shard",
        "refuse",
        "a shard's header broken",
        _write_file(first_shard, shard_bytes[:20] + b"#" + shard_bytes[21:]),
    )
    return cases


@pytest.mark.slow
def test_damaged_converted_directories_never_pass(tmp_path, converted):
    cases = verify_cases(converted)
    tally = Tally("damaged converted directories (convert verify)")
    for i, case in enumerate(cases):
        work = tmp_path / f"v{i}"
        shutil.copytree(converted, work / "conv")
        case.payload(work / "conv")
        listing = sorted(os.listdir(work / "conv"))
        args = ["verify", TINY_LLAMA, work / "conv", "--dtype", "float32", "--tokens", "16", "-q"]
        got, detail = outcome(invoke(args))
        leftovers = sorted(set(os.listdir(work)) ^ {"conv"}) + sorted(set(os.listdir(work / "conv")) ^ set(listing))
        tally.record(case, got, detail, leftovers)
        shutil.rmtree(work)
    tally.report()
    tally.check(N_VERIFY)
    assert tally.total("ok") == 0


def test_undamaged_converted_directory_passes(converted):
    """The guard on the guard: the directory every damage starts from verifies."""
    result = invoke(["verify", TINY_LLAMA, converted, "--dtype", "float32", "--tokens", "16", "-q"])
    assert outcome(result)[0] == "ok", result.output
