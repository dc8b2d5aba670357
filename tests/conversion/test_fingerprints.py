"""Behaviour unchanged: what `gqa2mla` writes for the shipped fixture and the real SmolLM2, each
layout, compressed and each export target, is what fixtures/fingerprints.py recorded before the
code was restructured (byte for byte on the machine that recorded it, to 1e-6 elsewhere)."""

import json
import math

import fingerprints as fp
import pytest

RECORDED = json.loads(fp.RECORD.read_text())
SAME_MACHINE = RECORDED["machine"] == fp.machine()


def _close(a, b, path: str) -> None:
    """Equal JSON values, numbers to a relative 1e-6 (another machine's BLAS rounds differently)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a.keys() ^ b.keys())} differ"
        for key in a:
            _close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_unchanged(now: dict, recorded: dict, where: str) -> None:
    if "refused" in recorded or "refused" in now:
        assert now.get("refused") == recorded.get("refused"), f"{where}: refusal changed"
    elif SAME_MACHINE:
        assert now["config_sha256"] == recorded["config_sha256"], f"{where}: config.json changed"
        changed = [
            n
            for n in recorded["tensors"]
            if now["tensors"].get(n, {}).get("sha256") != recorded["tensors"][n]["sha256"]
        ]
        assert now["tensors"].keys() == recorded["tensors"].keys(), f"{where}: tensor names changed"
        assert not changed, f"{where}: {len(changed)} tensors changed, first {changed[:3]}"
    else:
        _close(now["config"], recorded["config"], f"{where} config.json")
        strip = lambda t: {n: {k: v for k, v in e.items() if k != "sha256"} for n, e in t.items()}  # noqa: E731
        _close(strip(now["tensors"]), strip(recorded["tensors"]), f"{where} tensors")


def test_the_record_covers_every_case():
    assert set(RECORDED["models"]) == {"tiny-llama", "smollm2"}
    assert all(set(cases) == set(fp.CASES) for cases in RECORDED["models"].values())


def test_the_comparison_sees_a_changed_tensor():
    recorded = RECORDED["models"]["tiny-llama"]["absorbed"]
    changed = json.loads(json.dumps(recorded))
    name = sorted(changed["tensors"])[0]
    changed["tensors"][name]["sha256"] = "0" * 64
    changed["tensors"][name]["norm"] *= 1.001
    with pytest.raises(AssertionError, match="changed|!="):
        assert_unchanged(changed, recorded, "tampered")


@pytest.mark.parametrize("case", list(fp.CASES))
def test_tiny_llama_outputs_unchanged(case, tmp_path):
    calib = tmp_path / "tiny-calib.txt"  # the name the record was made with
    calib.write_text(fp.TINY_CALIB, encoding="utf-8")
    now = fp.convert_case(fp.HERE / "tiny-llama", tmp_path / "out", case, calib)
    assert_unchanged(now, RECORDED["models"]["tiny-llama"][case], f"tiny-llama {case}")


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("case", list(fp.CASES))
def test_smollm2_outputs_unchanged(case, smollm2, tmp_path):
    import realdata

    calib = tmp_path / "prideprejudice.txt"
    calib.write_text(realdata.austen_text("prideprejudice"), encoding="utf-8")
    now = fp.convert_case(smollm2, tmp_path / "out", case, calib)
    assert_unchanged(now, RECORDED["models"]["smollm2"][case], f"smollm2 {case}")
