"""The typed `mla` section (`convert.mla.config`): parsed from what a conversion writes, its checks
following from the field types, and the one section every consumer of a converted model reads."""

import dataclasses
import json

import pytest

from convert.api import gqa2mla
from convert.errors import ConvertError
from convert.mla.config import LayerEntry, MLASection
from convert.mla.model import read_mla_config
from tests.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A converted directory (exact, absorbed with RoPE) and its config.json's `mla`."""
    source = tmp_path_factory.mktemp("source")
    tiny_llama(2).save_pretrained(source, safe_serialization=True)
    out = tmp_path_factory.mktemp("converted") / "mla"
    gqa2mla(source, out, verify=False, progress=False)
    return out, json.loads((out / "config.json").read_text())["mla"]


def test_parse_keeps_every_written_value(written):
    out, mla = written
    section = MLASection.parse(mla, "config.json")
    for field in dataclasses.fields(MLASection):
        if field.name in mla and field.name != "layers":
            value = getattr(section, field.name)
            assert (list(value) if isinstance(value, tuple) else value) == mla[field.name], field.name
    assert len(section.layers) == mla["n_layers"]
    for entry, layer in zip(section.layers, mla["layers"]):
        assert entry.ranks == {k: v for k, v in layer.items() if k.startswith("rank")}
        assert list(entry.key_freq_index) == layer["key_freq_index"] and list(entry.bias) == layer["bias"]
        assert entry.factor_error == layer["factor_error"]
    assert section.prefix(1) == mla["layer_prefix"].format(i=1)
    assert read_mla_config(out)[1] == section  # what loading hands on is this parse
    assert MLASection.from_dict(mla) == section


def test_joint_ranks():
    entry = LayerEntry(rank_kv=12)
    assert (entry.key_rank, entry.value_rank, entry.ranks) == (12, 12, {"rank_kv": 12})
    split = LayerEntry(rank_k=8, rank_v=4)
    assert (split.key_rank, split.value_rank, split.ranks) == (8, 4, {"rank_k": 8, "rank_v": 4})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_heads", "4", "mla.n_heads='4' is a string, not an integer"),  # Count
        ("n_kv_heads", 0, "mla.n_kv_heads=0"),  # Count: positive
        ("softmax_scale", -1.0, "mla.softmax_scale=-1.0"),  # Positive
        ("causal", "yes", "mla.causal='yes' is a string, not a boolean"),  # Flag
        ("layout", "diagonal", "mla.layout='diagonal' is not known"),  # a choice
        ("layer_prefix", "", "mla.layer_prefix='' is a string, not a name"),  # Name
    ],
)
def test_checks_follow_from_the_field_types(written, field, value, message):
    _, mla = written
    with pytest.raises(ConvertError, match="re-convert") as err:
        MLASection.parse(mla | {field: value}, "config.json")
    assert str(err.value).startswith(f"config.json {message}")


def test_a_missing_required_field_and_a_short_layer_list_are_refused(written):
    _, mla = written
    without = {k: v for k, v in mla.items() if k != "head_dim"}
    with pytest.raises(ConvertError, match="mla has no 'head_dim'"):
        MLASection.parse(without, "config.json")
    with pytest.raises(ConvertError, match="mla.layers has 1 entries but mla.n_layers=2"):
        MLASection.parse(mla | {"layers": mla["layers"][:1]}, "config.json")
    with pytest.raises(ConvertError, match=r"mla.layers\[0\] has 'rank_kv', not a rank of a split latent"):
        MLASection.parse(mla | {"layers": [mla["layers"][0] | {"rank_kv": 4}, *mla["layers"][1:]]}, "config.json")
