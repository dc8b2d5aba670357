"""The target interface is declared (`convert.targets.Target`, `ExportTarget`), every module in the
table implements it with the declared signatures, and the table alone says which target wrote an
output (verification and evaluation ask it)."""

import inspect
import json
import types

import pytest

from convert.evaluate import model_format
from convert.targets import TARGETS, ExportTarget, Target, output_target, target, written_by
from convert.verify import is_export


def _declared(protocol) -> dict[str, inspect.Signature]:
    """The protocol's methods and their signatures without `self`."""
    methods = {}
    for name, member in vars(protocol).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            signature = inspect.signature(member)
            methods[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return methods


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_implements_the_declared_interface(name):
    module = target(name)
    protocols = (Target, ExportTarget) if TARGETS[name].export else (Target,)
    for protocol in protocols:
        assert isinstance(module, protocol), (name, protocol.__name__)
        for method, declared in _declared(protocol).items():
            given = inspect.signature(getattr(module, method))
            assert list(given.parameters) == list(declared.parameters), (name, method, given, declared)
    assert module.NAME == name


def test_the_protocol_check_fails_for_a_module_missing_a_verb():
    """The structural check can fail: a module without `load` is not a Target."""
    module = types.SimpleNamespace(**{k: getattr(target("mla"), k) for k in ("NAME", "FOREIGN", "check", "build")})
    assert not isinstance(module, Target)
    assert not isinstance(target("mla"), ExportTarget)  # the native format has no export report


@pytest.mark.parametrize(
    ("config", "name"),
    [
        ({"model_type": "convert_mla", "mla": {"format_version": 2}}, "mla"),
        ({"model_type": "deepseek_v3", "convert_export": {"target": "vllm"}}, "vllm"),
        ({"model_type": "deepseek_v3", "convert_export": {"exact": True}}, "transformers"),  # before the field
        ({"model_type": "llama"}, None),
    ],
)
def test_the_table_says_which_target_wrote_an_output(config, name, tmp_path):
    assert written_by(config) == name
    assert model_format(config) == (name or "original")
    assert output_target(config).NAME == (name or "mla")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert is_export(tmp_path) == (name in ("transformers", "vllm"))
