"""Behaviour unchanged: what `gqa2mla` writes for the shipped fixture and the real SmolLM2, each
layout, compressed and each export target, is byte for byte what fixtures/fingerprints.py recorded
before the code was restructured (re-recorded where a change was meant), on the machine it was
recorded on (`fp.machine()`: CPU model and generation, vector instructions, torch, threads).
Elsewhere: the same tensors and config fields, and the exact outputs' tensor norms to 1e-6."""

import json
import math

import fingerprints as fp
import pytest

RECORDED = json.loads(fp.RECORD.read_text())
#: The record made on this machine (CPU model, torch, threads), if any: BLAS rounds a factorization's
#: last bits, and picks its singular vectors' signs, its own way on each CPU.
THIS_MACHINE = next((r for r in [RECORDED, *RECORDED.get("elsewhere", [])] if r["machine"] == fp.machine()), None)


def assert_unchanged(now: dict, model: str, case: str) -> None:
    main, where = RECORDED["models"][model][case], f"{model} {case}"
    if "refused" in main or "refused" in now:  # the message is the same on every machine
        assert now.get("refused") == main.get("refused"), f"{where}: refusal changed"
    elif THIS_MACHINE is not None:
        assert_same_bytes(now, THIS_MACHINE["models"][model][case], where)
    else:
        assert_same_structure(now, main, where, exact=case not in fp.FITTED)


def assert_same_bytes(now: dict, recorded: dict, where: str) -> None:
    assert now["config_sha256"] == recorded["config_sha256"], f"{where}: config.json changed"
    assert now["tensors"].keys() == recorded["tensors"].keys(), f"{where}: tensor names changed"
    changed = [n for n, was in recorded["tensors"].items() if now["tensors"][n]["sha256"] != was["sha256"]]
    assert not changed, f"{where}: {len(changed)} tensors changed, first {changed[:3]}"


def assert_same_structure(now: dict, recorded: dict, where: str, exact: bool) -> None:
    """What another CPU can promise: config.json's fields and every value but its floats, each
    tensor's name, dtype and shape, and (an exact output: no fit to calibration text, whose steps
    carry BLAS's rounding on) each tensor's norm to a relative 1e-6. Sums are not compared: an
    SVD's singular-vector signs are BLAS's choice."""
    assert _shape_of(now["config"]) == _shape_of(recorded["config"]), f"{where}: config.json changed"
    assert now["tensors"].keys() == recorded["tensors"].keys(), f"{where}: tensor names changed"
    for name, was in recorded["tensors"].items():
        got = now["tensors"][name]
        assert (got["dtype"], got["shape"]) == (was["dtype"], was["shape"]), f"{where} {name}: dtype or shape"
        if exact:
            assert math.isclose(got["norm"], was["norm"], rel_tol=1e-6, abs_tol=1e-9), (
                f"{where} {name}: norm {got['norm']} != {was['norm']}"
            )


def _shape_of(value):
    """A JSON value with each float replaced by the word "float"."""
    if isinstance(value, dict):
        return {key: _shape_of(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape_of(item) for item in value]
    return "float" if isinstance(value, float) else value


def test_the_records_cover_every_case():
    for record in [RECORDED, *RECORDED.get("elsewhere", [])]:
        assert set(record["models"]) == {"tiny-llama", "smollm2"}, record["machine"]
        assert all(set(cases) == set(fp.CASES) for cases in record["models"].values()), record["machine"]


def _tampered(case: str, name: str, **changes) -> dict:
    recorded = json.loads(json.dumps(RECORDED["models"]["tiny-llama"][case]))
    recorded["tensors"][name].update(changes)
    return recorded


def test_the_comparisons_see_a_changed_tensor():
    recorded = RECORDED["models"]["tiny-llama"]["absorbed"]
    name = sorted(recorded["tensors"])[0]
    with pytest.raises(AssertionError, match="1 tensors changed"):
        assert_same_bytes(_tampered("absorbed", name, sha256="0" * 64), recorded, "tampered")
    assert_same_structure(recorded, recorded, "unchanged", exact=True)
    for changes, exact in [({"norm": recorded["tensors"][name]["norm"] * 1.00001}, True), ({"shape": [1]}, False)]:
        with pytest.raises(AssertionError, match="norm|shape"):
            assert_same_structure(_tampered("absorbed", name, **changes), recorded, "tampered", exact=exact)


def test_another_machines_comparison_sees_a_changed_config():
    recorded = RECORDED["models"]["tiny-llama"]["factored-kv50"]
    changed = json.loads(json.dumps(recorded))
    changed["config"]["mla"]["layers"][0]["rank_k"] += 1
    with pytest.raises(AssertionError, match="config.json changed"):
        assert_same_structure(changed, recorded, "tampered", exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(fp.CASES))
def test_tiny_llama_outputs_unchanged(case, tmp_path):
    calib = tmp_path / "tiny-calib.txt"  # the name the record was made with
    calib.write_text(fp.TINY_CALIB, encoding="utf-8")
    now = fp.convert_case(fp.HERE / "tiny-llama", tmp_path / "out", case, calib)
    assert_unchanged(now, "tiny-llama", case)


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("case", list(fp.CASES))
def test_smollm2_outputs_unchanged(case, smollm2, tmp_path):
    import realdata

    calib = tmp_path / "prideprejudice.txt"
    calib.write_text(realdata.austen_text("prideprejudice"), encoding="utf-8")
    now = fp.convert_case(smollm2, tmp_path / "out", case, calib)
    assert_unchanged(now, "smollm2", case)
