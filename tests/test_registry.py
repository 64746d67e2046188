"""Registries: lazy built-ins, decorators, entry points of installed plug-ins, nearest-name errors."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import pytest

from geofm.errors import ConfigError
from geofm.registry import Registry


def test_lazy_entry_imports_on_first_get():
    reg = Registry("thing", "geofm.tests-none")
    reg.register("dumps", "json:dumps")
    assert reg.names() == ["dumps"]
    import json

    assert reg.get("dumps") is json.dumps


def test_decorator_registers_the_object():
    reg = Registry("thing", "geofm.tests-none")

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double") is double and "double" in reg


def test_unknown_name_lists_the_nearest():
    reg = Registry("algorithm", "geofm.tests-none")
    for name in ("fedavg", "fedprox", "scaffold"):
        reg.register(name, "json:dumps")
    with pytest.raises(ConfigError, match=r"unknown algorithm 'fedavgm'; did you mean 'fedavg'") as err:
        reg.get("fedavgm")
    assert "registered: fedavg, fedprox, scaffold" in str(err.value)
    with pytest.raises(ValueError, match="did you mean 'scaffold'"):
        reg.check("scafold")


def test_broken_lazy_entry_names_the_module():
    reg = Registry("task", "geofm.tests-none")
    reg.register("gone", "no_such_module_anywhere:thing")
    reg.register("missing", "json:no_such_attribute")
    with pytest.raises(ConfigError, match="task 'gone': cannot import 'no_such_module_anywhere'"):
        reg.get("gone")
    with pytest.raises(ConfigError, match="module 'json' has no attribute 'no_such_attribute'"):
        reg.get("missing")
    with pytest.raises(ValueError, match=r"package\.module:attribute"):
        reg.register("bad", "json.dumps")


def test_installed_plugin_registers_through_its_entry_point(tmp_path, monkeypatch):
    """A package installed beside geofm adds an entry without editing geofm: its dist-info's entry points."""
    (tmp_path / "geofm_plugin_demo.py").write_text("def make():\n    return 'from the plug-in'\n")
    dist = tmp_path / "geofm_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: geofm-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[geofm.tests-plugins]\nplugged = geofm_plugin_demo:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    reg = Registry("thing", "geofm.tests-plugins")
    reg.register("builtin", "json:dumps")
    assert reg.names() == ["builtin", "plugged"]
    assert reg.get("plugged")() == "from the plug-in"
    sys.modules.pop("geofm_plugin_demo", None)


def test_summary_reads_a_lazy_entrys_docstring_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "geofm_summary_demo.py").write_text(
        'class Fancy:\n    """A fancy thing:\n    two lines.\n\n    Details.\n    """\n\n\n'
        'MADE = Fancy()\n"""The made one."""\nBARE = 1\nPLAIN = Fancy()\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("thing", "geofm.tests-none")
    for name in ("Fancy", "MADE", "BARE", "PLAIN"):
        reg.register(name.lower(), f"geofm_summary_demo:{name}")

    @reg.register("coded")
    def coded():
        """Registered in code."""

    summaries = {name: reg.summary(name) for name in reg}
    assert summaries == {
        "fancy": "A fancy thing: two lines.",
        "made": "The made one.",
        "bare": "",
        "plain": "A fancy thing: two lines.",  # an instance without its own docstring: its class's, as once imported
        "coded": "Registered in code.",
    }
    assert "geofm_summary_demo" not in sys.modules, "listing imports no entry"


def test_every_registry_of_the_project_is_listed():
    """``geofm list`` knows each registry a module defines: a module-level ``NAME = Registry(...)``."""
    import ast
    from pathlib import Path

    from geofm.registry import REGISTRIES

    root = Path(__file__).parents[1]
    defined = set()
    for package in ("geofm", "federation", "pretrain", "finetune", "benchmarks"):
        for path in (root / package).rglob("*.py"):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.parse(path.read_text()).body:
                value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Registry":
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    defined.add(f"{module}:{target.id}")
    listed = [REGISTRIES.get(kind) for kind in REGISTRIES]
    for entry in sorted(defined - {"geofm.registry:REGISTRIES"}):
        module, name = entry.split(":")
        assert any(getattr(importlib.import_module(module), name) is registry for registry in listed), entry


def test_unregister_removes_an_entry_and_refuses_an_unknown_name():
    reg = Registry("thing", "geofm.tests-none")
    reg.register("dumps", "json:dumps")
    reg.register("loads", "json:loads")
    reg.unregister("dumps")
    assert reg.names() == ["loads"]
    with pytest.raises(ConfigError, match=r"unknown thing 'dumps' \(registered: loads\)"):
        reg.unregister("dumps")


def test_an_entrys_options_are_validated_by_its_options_model_and_listed_field_by_field():
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        width: int = Field(default=8, gt=0, description="how wide")
        mode: Literal["a", "b"] | None = None
        seed: int = Field(description="required, no default")

    reg = Registry("thing", "geofm.tests-none")
    reg.register("optioned", type("Optioned", (), {"Options": Options}))
    reg.register("plain", "json:dumps")
    assert reg.options("optioned", {"seed": 1, "width": 3}, "thing.options") == Options(seed=1, width=3)
    assert reg.options("plain", {}, "thing.options") is None
    with pytest.raises(ValueError, match=r"thing\.options\.width: Input should be greater than 0"):
        reg.options("optioned", {"seed": 1, "width": 0}, "thing.options")
    with pytest.raises(ValueError, match=r"thing\.options: plain takes no options, got \['width'\]"):
        reg.options("plain", {"width": 3}, "thing.options")
    assert reg.option_rows("optioned") == [
        ("width", "int", "8", "how wide"),
        ("mode", "Literal['a', 'b'] | None", "None", ""),
        ("seed", "int", "required", "required, no default"),
    ]
    assert reg.option_rows("plain") == []


@pytest.mark.slow  # imports every registered entry (torch, timm, the task and algorithm modules)
def test_a_misspelt_option_of_any_entry_gets_the_keys_it_may_have_meant():
    from geofm.registry import REGISTRIES

    checked = []
    for kind in REGISTRIES:
        registry = REGISTRIES.get(kind)
        for name in registry:
            model = registry.options_model(name)
            if not isinstance(model, type) or not model.model_fields:
                continue
            field = next(iter(model.model_fields))
            with pytest.raises(
                ValueError, match=rf"^x\.options\.{field}z: unknown key \(did you mean [\w ]*\b{field}\b"
            ):
                registry.options(name, {f"{field}z": 1}, "x.options")
            checked.append(f"{kind}:{name}")
    kinds = {entry.split(":")[0] for entry in checked}
    assert {"tasks", "algorithms", "heads", "aggregators", "server-optimizers", "product-layouts"} <= kinds, checked
