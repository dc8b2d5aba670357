"""Half-precision verdicts: an exact conversion of a bfloat16/float16 checkpoint is held to the noise
floor of the original's equivalent twin (convert/verify/twin.py, docs/design.md "Verification"),
measured in the same run; a broken one FAILs, in half precision and in float32."""

import json

import pytest
import torch
from click.testing import CliRunner
from tamper import TAMPERS, tampered_copy

import convert
from convert.cli import main
from convert.hf import load_original
from convert.io import open_checkpoint
from convert.layouts import module_layout
from convert.verify.decision import FLOOR_FACTOR, decide, thresholds
from convert.verify.twin import TWIN_SCALE, twin_view

from conftest import PROSE, hf_model, random_ids, rel_err

TAMPER_LAYER = 5


def _source(tmp_path, model_type: str, dtype, **overrides) -> tuple:
    """A tiny model of `model_type` (random attention biases where it has them) saved in `dtype`:
    (checkpoint directory, its config.json)."""
    path = tmp_path / f"{model_type}-{dtype}"
    hf_model(model_type, dtype=dtype, **overrides).save_pretrained(path)
    return path, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3", "gemma2", "qwen3", "olmo2", "gemma3_text"])
def test_twin_is_the_original_in_exact_arithmetic(tmp_path, model_type):
    """In float64 the twin computes what the original computes, while its attention weights differ from
    the original's. A q/k norm divides the twin's factor out exactly but for its eps (docs/design.md):
    those families are built with eps 1e-30 here, and checked to float32 round-off, in which transformers
    computes their norms whatever the model's dtype."""
    normed = model_type in ("qwen3", "olmo2", "gemma3_text")
    path, config = _source(tmp_path, model_type, torch.float64, **({"rms_norm_eps": 1e-30} if normed else {}))
    with open_checkpoint(path) as ckpt:
        original = module_layout(ckpt, config)
        twin = twin_view(original, config)
        ids = random_ids()
        with torch.no_grad():
            ref = load_original(original, config, "cpu", torch.float64)(ids).logits
            got = load_original(twin, config, "cpu", torch.float64)(ids).logits
        changed = [n for n in twin.virtual if not torch.equal(twin.read(n), original.read(n))]
    assert rel_err(got, ref) <= (1e-6 if normed else 1e-12), rel_err(got, ref)
    assert len(changed) == len(twin.virtual) >= 2 * config["num_hidden_layers"]


def test_twin_differs_by_one_rounding_in_bfloat16(tmp_path):
    """Stored in bfloat16, each twin weight is the original's times s (or 1/s), rounded once."""
    path, config = _source(tmp_path, "llama", torch.bfloat16)
    with open_checkpoint(path) as ckpt:
        twin = twin_view(ckpt, config)
        name = "model.layers.0.self_attn.q_proj.weight"
        original, scaled = ckpt.read(name).double(), twin.read(name)
    assert scaled.dtype == torch.bfloat16
    error = (scaled.double() / TWIN_SCALE - original).abs() / original.abs()
    assert 0 < error.max() <= 2**-8  # bfloat16 rounds to 8 significant bits: half an ulp is 2^-8 at most


def _layers(rel: list[float], floor: list[float]) -> list[dict]:
    return [{"layer": i, "rel_error": r, "floor_rel_error": f} for i, (r, f) in enumerate(zip(rel, floor))]


def _e2e(logits: float, ppl_ratio: float, top1: float, floor_logits: float, floor_nll: float, floor_top1: float):
    floor = {"logits_rel_error": floor_logits, "nll_abs_diff_mean": floor_nll, "top1_agreement": floor_top1}
    return {"tokens": 1000, "logits_rel_error": logits, "ppl_ratio": ppl_ratio, "top1_agreement": top1} | {
        "ppl_original": 10.0,
        "ppl_converted": 10.0 * ppl_ratio,
        "floor": floor,
    }


def test_noise_floor_rule_passes_within_the_factor_and_fails_above_it():
    limits = thresholds("bfloat16", None)
    assert limits["noise_floor"] and limits["floor_factor"] == FLOOR_FACTOR and limits["top1_agreement"] is None
    e2e = _e2e(3e-3, 1.0006, 0.996, 2.8e-3, 5e-3, 0.997)
    decision = decide(_layers([1e-2, 3e-3], [4e-3, 3e-3]), e2e, limits)
    assert decision["verdict"] == "PASS" and decision["rule"].startswith("exact conversion in bfloat16")
    assert all(c["over"] <= 1 for c in decision["checks"])
    broken = decide(_layers([1e-2, 3.4e-2], [4e-3, 3e-3]), e2e, limits)
    assert broken["verdict"] == "FAIL"
    assert broken["failures"] == [
        "layer 1: attention output relative error 3.400e-02 > 4× the noise floor 3.000e-03 = 1.200e-02 (2.8× its bound)"
    ]


def test_top1_floor_counts_at_least_one_token():
    """A twin that agreed on every token still allows FLOOR_FACTOR tokens' worth of disagreement."""
    limits = thresholds("float16", None)
    within = decide([], _e2e(1e-3, 1.0, 1 - FLOOR_FACTOR / 1000, 1e-3, 1e-3, 1.0), limits)
    beyond = decide([], _e2e(1e-3, 1.0, 1 - (FLOOR_FACTOR + 1) / 1000, 1e-3, 1e-3, 1.0), limits)
    assert within["verdict"] == "PASS" and beyond["verdict"] == "FAIL", beyond["failures"]
    assert beyond["failures"][0] == "top-1 disagreement 5 > 4× the noise floor 1 = 4 (1.2× its bound)"


def test_float32_and_lossy_keep_their_rules():
    assert not thresholds("float32", None)["noise_floor"] and thresholds("float32", None)["top1_agreement"] == 0.999
    lossy = thresholds("bfloat16", 1.2)
    assert not lossy["noise_floor"]
    decision = decide([], {"ppl_ratio": 1.1}, lossy)
    assert decision["verdict"] == "PASS" and decision["rule"].startswith("lossy")


@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_bfloat16_tiny_conversion_reports_the_floor_side_by_side(tmp_path, layout):
    path, _ = _source(tmp_path, "llama", torch.bfloat16)
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    result = convert.gqa2mla(path, tmp_path / "out", layout=layout, text=text, tokens=64, progress=False)
    report = result.report
    assert report["verdict"] == "PASS", report["failures"]
    assert report["thresholds"]["noise_floor"] and report["dtype"] == "float32"
    assert all(r["floor_rel_error"] > 0 for r in report["layers"])
    assert report["end_to_end"]["floor"]["logits_rel_error"] > 0
    markdown = (result.output / "verification.md").read_text()
    assert "noise floor (twin)" in markdown and "| figure | converted | twin (floor) |" in markdown


# ------------------------------------------------------------------ the real SmolLM2


@pytest.fixture(scope="session")
def emma_file(tmp_path_factory):
    import realdata

    path = tmp_path_factory.mktemp("emma") / "emma.txt"
    path.write_text(realdata.austen_text("emma"), encoding="utf-8")
    return path


def _smollm2(dtype: str):
    import realdata

    return realdata.smollm2_dir() if dtype == "float32" else realdata.smollm2_cast_dir(dtype)


def _cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _print_checks(title: str, report: dict) -> None:
    print(f"\n{title}: {report['verdict']} ({report['decision']['rule']})")
    for c in report["decision"]["checks"]:
        if c["over"] is not None and (not c["ok"] or not c["name"].startswith("layer ")):
            print(f"  {c['name']}: {c['value']:.4g} {c['bound']} -> {c['over']:.2f}x its bound")


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["absorbed", "factored"])
def test_exact_half_precision_conversion_passes(tmp_path, emma_file, dtype, layout):
    """SmolLM2 stored in half precision, converted exactly at the defaults: exit 0, PASS."""
    out = tmp_path / "out"
    code, output = _cli("gqa2mla", _smollm2(dtype), "-o", out, "--layout", layout, "--text", emma_file, "-q")
    report = json.loads((out / "verification.json").read_text())
    _print_checks(f"SmolLM2 {dtype} {layout}", report)
    assert code == 0, (output, report["failures"])
    assert report["thresholds"]["noise_floor"] and report["end_to_end"]["floor"]


#: (checkpoint dtype, layout) of the broken conversions: both layouts under the noise floor, and float32's
#: fixed bounds (the same code decides for both float32 layouts).
TAMPERED = [("bfloat16", "absorbed"), ("bfloat16", "factored"), ("float32", "absorbed")]


@pytest.fixture(scope="session", params=TAMPERED, ids=["-".join(p) for p in TAMPERED])
def smollm2_exact(request, tmp_path_factory):
    """(source, its exact conversion) of SmolLM2 in a dtype and layout of TAMPERED, once per session."""
    dtype, layout = request.param
    src = _smollm2(dtype)
    out = tmp_path_factory.mktemp("exact") / f"smollm2-{dtype}-{layout}"
    convert.gqa2mla(src, out, layout=layout, verify=False, progress=False)
    return src, out


@pytest.mark.realdata
@pytest.mark.slow
@pytest.mark.parametrize("kind", TAMPERS)
def test_broken_conversion_fails(tmp_path, emma_file, smollm2_exact, kind):
    """One layer damaged: exit 1, the damaged layer among the failures, each failed figure over its bound."""
    src, exact = smollm2_exact
    broken = tampered_copy(exact, tmp_path / "broken", kind, TAMPER_LAYER)
    code, output = _cli("verify", src, broken, "--text", emma_file, "--tokens", 128, "--report-dir", tmp_path, "-q")
    report = json.loads((tmp_path / "verification.json").read_text())
    _print_checks(f"SmolLM2 {exact.name} with {kind} in layer {TAMPER_LAYER}", report)
    assert code == 1, output
    assert any(f.startswith(f"layer {TAMPER_LAYER}:") for f in report["failures"]), report["failures"]
