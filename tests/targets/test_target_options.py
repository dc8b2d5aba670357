"""Which flags each target takes: derived from the options' declarations (`Flag.needs`), refused in one line.

Raised outside the command line, a refusal names the API's keywords (`kv_cache_ratio`, `target='mla'`)."""

import dataclasses

import pytest

from convert.errors import ConvertError
from convert.options import ConvertOptions, long_flag
from convert.targets import TARGETS, check_options

#: a value of its own for every option a target may not take
GIVEN = {
    "layout": "factored",
    "latent": "joint",
    "kv_cache_ratio": 0.5,
    "rank": 8,
    "method": "svd",
    "calib": ["book.txt"],
    "allocation": "uniform",
    "calibration": "original",
    "refine_queries": 64,
    "max_ppl_ratio": 1.2,
}
SHAPE = {"--layout", "--latent", "--kv-cache-ratio", "--rank", "--method", "--allocation"}
CALIBRATION = {"--calib", "--calibration", "--refine-queries", "--max-ppl-ratio"}
#: what each target refuses, written out (the hand-made list `check_options` was before the declarations)
REFUSED = {
    "mla": set(),
    "transformers": SHAPE | CALIBRATION,
    "vllm": SHAPE,
    "llamacpp": SHAPE - {"--kv-cache-ratio"},
}


def _needing() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(ConvertOptions) if f.metadata.get("needs")}


def test_every_option_a_target_may_refuse_is_declared_so():
    assert set(_needing()) == set(GIVEN)
    assert set(REFUSED) == set(TARGETS)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_refuses_exactly_the_flags_it_would_ignore(target):
    for name, field in _needing().items():
        opts = ConvertOptions(target=target, **{name: GIVEN[name]})
        flag = long_flag(field)
        if flag in REFUSED[target]:
            with pytest.raises(ConvertError, match=rf"^{name}: only for target='mla' \(target='{target}' "):
                check_options(opts)
        else:
            check_options(opts)


def test_a_default_given_again_is_not_refused_and_several_are_named_in_one_line():
    check_options(ConvertOptions(target="vllm", layout="absorbed", latent="split"))
    with pytest.raises(ConvertError) as refused:
        check_options(ConvertOptions(target="transformers", layout="factored", calib=["book.txt"]))
    assert str(refused.value).startswith("layout, calib: only for target='mla'")
