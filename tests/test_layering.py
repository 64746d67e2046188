"""The layering rules of the README, checked on every module's imports (static and inside functions).

``geofm/`` is the library and imports none of the programs; ``pretrain/``, ``finetune/`` and
``federation/`` are programs on top of it and import no other program (tasks and federated programs
are reached by registered name, :mod:`geofm.registry`); a heavy engine has one importer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("pretrain", "finetune", "federation", "benchmarks")
# package -> the project packages it must not import
FORBIDDEN = {
    "geofm": set(PROGRAMS),
    "pretrain": {"finetune", "federation", "benchmarks"},
    "finetune": {"pretrain", "federation", "benchmarks"},
    "federation": {"pretrain", "finetune", "benchmarks"},
}
# third-party module -> the only project modules allowed to import it
SOLE_IMPORTERS = {
    "flwr": ["federation/flower.py", "federation/simulation.py"],
    "deepspeed": ["geofm/engine.py"],
    "rasterio": ["geofm/data/readers.py", "geofm/data/row_stream.py", "geofm/data/writers.py"],
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_no_program_above_it(package):
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(package)
        for name in sorted(_imports(path))
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert not offences, "\n".join(offences)


@pytest.mark.parametrize("library", sorted(SOLE_IMPORTERS))
def test_heavy_engine_has_only_its_own_importers(library):
    importers = sorted(
        str(path.relative_to(ROOT))
        for package in ("geofm", *PROGRAMS)
        for path in _modules(package)
        if any(name.split(".")[0] == library for name in _imports(path))
    )
    assert importers == SOLE_IMPORTERS[library]
