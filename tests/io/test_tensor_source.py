"""`TensorSource`: every source of tensors (a checkpoint file, a state dict, a view of either) answers
the same verbs with the same values, and the protocol check refuses an object that lacks one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from convert.io import TensorSource, open_checkpoint
from convert.layouts import TensorView, VirtualTensor
from convert.source import StateDictSource


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4, generator=g),
        "proj.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(4, generator=g, dtype=torch.float64),
    }


@pytest.fixture
def sources(tmp_path: Path):
    """The same tensors as each kind of source: {kind: source}."""
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path) as checkpoint:
        state = StateDictSource(dict(tensors), {})
        yield {
            "checkpoint": checkpoint,
            "state_dict": state,
            "view_of_checkpoint": TensorView(checkpoint, {}),
            "view_of_state_dict": TensorView(state, {}),
        }


def test_every_source_is_a_tensor_source(sources) -> None:
    for kind, source in sources.items():
        assert isinstance(source, TensorSource), kind


def test_every_source_gives_the_same_tensors(sources) -> None:
    tensors = _tensors()
    for kind, source in sources.items():
        assert sorted(source.keys()) == sorted(tensors), kind
        for name, want in tensors.items():
            assert name in source, (kind, name)
            assert tuple(source.shape(name)) == tuple(want.shape), (kind, name)
            assert source.dtype(name) == want.dtype, (kind, name)
            assert torch.equal(source.read(name), want), (kind, name)
            assert torch.equal(source.get(name), want), (kind, name)
        assert torch.equal(source.read_rows("embed.weight", 3, 7), tensors["embed.weight"][3:7]), kind
        assert torch.equal(source.read_rows("embed.weight", 8, 99), tensors["embed.weight"][8:]), kind  # clamped
        assert "missing.weight" not in source, kind


def test_read_into_fills_a_tensor_from_every_source(sources) -> None:
    want = _tensors()["proj.weight"]
    for kind, source in sources.items():
        target = torch.full((6, 4), float("nan"), dtype=torch.float32)
        source.read_into("proj.weight", target)
        assert torch.equal(target, want.float()), kind


def test_raw_span_is_the_stored_bytes_or_none(sources) -> None:
    checkpoint = sources["checkpoint"]
    path, offset, nbytes = checkpoint.raw_span("proj.weight")
    with open(path, "rb") as f:
        f.seek(offset)
        stored = f.read(nbytes)
    assert stored == _tensors()["proj.weight"].view(torch.uint8).numpy().tobytes()
    assert sources["view_of_checkpoint"].raw_span("proj.weight") == (path, offset, nbytes)
    assert sources["state_dict"].raw_span("proj.weight") is None  # in memory: no bytes on disk
    assert sources["view_of_state_dict"].raw_span("proj.weight") is None


def test_a_view_reads_its_virtual_tensors_through_the_same_verbs(sources) -> None:
    """A virtual tensor (here: the embedding doubled, standing in for itself) reads the same from
    a view of a file and a view of a state dict, and has no raw span: it is assembled."""
    want = 2 * _tensors()["embed.weight"]
    double = VirtualTensor((10, 4), torch.float32, ("embed.weight",), lambda read: 2 * read("embed.weight"))
    for kind in ("checkpoint", "state_dict"):
        view = TensorView(sources[kind], {"embed.weight": double})
        assert isinstance(view, TensorSource), kind
        assert torch.equal(view.read("embed.weight"), want), kind
        assert torch.equal(view.read_rows("embed.weight", 2, 5), want[2:5]), kind
        assert view.raw_span("embed.weight") is None, kind


def test_a_view_hands_on_only_what_its_stored_source_has(sources) -> None:
    """No attribute forwarding beyond the named ones: a view of a state dict has no file facts."""
    of_file, of_dict = sources["view_of_checkpoint"], sources["view_of_state_dict"]
    assert of_file.path == sources["checkpoint"].path and of_file.root == sources["checkpoint"].root
    assert of_file.config is sources["checkpoint"].config
    assert of_dict.config == {}
    assert getattr(of_dict, "root", None) is None
    with pytest.raises(AttributeError):
        of_file.raw_bytes  # noqa: B018 - a Checkpoint extra the view does not pass on


class _NoRows:
    """Every verb but `read_rows` (a source from before it was a verb)."""

    def keys(self) -> list[str]:
        return ["t"]

    def __contains__(self, name: object) -> bool:
        return name == "t"

    def shape(self, name: str) -> tuple[int, ...]:
        return (1,)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def read(self, name: str) -> torch.Tensor:
        return torch.zeros(1)

    def raw_span(self, name: str) -> None:
        return None


def test_an_object_lacking_a_verb_is_not_a_tensor_source() -> None:
    assert not isinstance(_NoRows(), TensorSource)
    assert not isinstance({"t": torch.zeros(1)}, TensorSource)  # a plain state dict neither
    with_rows = type("WithRows", (_NoRows,), {"read_rows": lambda self, name, start, stop: torch.zeros(1)})
    assert isinstance(with_rows(), TensorSource)
