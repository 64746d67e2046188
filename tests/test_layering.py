"""The layering rules of docs/architecture.md, checked on every module's imports (static and inside functions).

``geofm/`` is the library and imports none of the programs; ``pretrain/``, ``finetune/`` and
``federation/`` are programs on top of it and import no other program (tasks and federated programs
are reached by registered name, :mod:`geofm.registry`); a heavy engine has one importer.

The project stands on the layers of :data:`LAYERS` (drawn in docs/architecture.md): no module imports
one of a higher layer. Imports form no cycle between modules, nor between folders (a folder of modules
is one unit; a module beside subpackages, as ``geofm/errors.py`` or ``geofm/fl/client_round.py``, is a
unit of its own). An import inside a function counts as much as one at module level (it runs when the
function does, and a cycle it closes is a cycle all the same); an import under ``if TYPE_CHECKING:``
never runs and does not count, and neither does a registry's lazy ``"module:attr"`` entry, which is how
a lower layer reaches what registers above it (a task reaches the programs that run it so:
:data:`geofm.tasks.FEDERATED_TASKS`). Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b``
first, so those count as imported too.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Collection, Mapping
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
# The layers, lowest first: (name, the modules and packages in it); a module is in the layer of the
# longest name that holds it. geofm.tasks is the task interface and registry, its objectives a layer up.
LAYERS = [
    (
        "foundations",
        (
            "geofm",
            "geofm.errors",
            "geofm.schema",
            "geofm.registry",
            "geofm.paths",
            "geofm.memory",
            "geofm.runlog",
            "geofm.loggers",
            "geofm.objective_settings",
            "geofm.tasks",
        ),
    ),
    ("data", ("geofm.data",)),
    ("models", ("geofm.models",)),
    ("checkpoints", ("geofm.checkpoints",)),
    ("config", ("geofm.config",)),
    ("training", ("geofm.training",)),
    ("federated learning", ("geofm.fl",)),
    ("objectives", ("geofm.tasks.pretraining", "geofm.tasks.mim", "geofm.tasks.dino", "geofm.tasks.finetuning")),
    ("integrations and command line", ("geofm.integrations", "geofm.cli")),
    ("federated runtime", ("federation", "federation.runtime")),
    ("deployment", ("federation.deploy",)),
    ("programs", ("pretrain", "finetune", "federation.flower", "federation.programs")),
    ("program commands", ("federation.sweep", "federation.cli")),
    ("benchmarks", ("benchmarks",)),
]
# third-party module -> the only project modules allowed to import it
SOLE_IMPORTERS = {
    "flwr": ["federation/flower/adapter.py", "federation/flower/simulation.py"],
    "deepspeed": ["geofm/training/engine.py"],
    "rasterio": ["geofm/data/block_stream.py", "geofm/data/readers.py", "geofm/data/writers.py"],
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


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_imports(tree: ast.Module, modules: Collection[str]) -> set[str]:
    """The modules an import of ``tree`` or a call of its functions imports (``from m import name`` of a
    submodule ``m.name`` imports the submodule); imports under ``if TYPE_CHECKING:`` never run."""
    found: set[str] = set()
    for node in ast.walk(_without_type_checking(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found


def _without_type_checking(tree: ast.Module) -> ast.Module:
    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | None:
            return None if "TYPE_CHECKING" in ast.unparse(node.test) else self.generic_visit(node)

    return Strip().visit(tree)


def import_graph(root: Path, *packages: str) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` that importing it or calling its functions imports, with the
    ``__init__`` of every package above each."""
    paths = {_module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for imported in _run_imports(ast.parse(path.read_text(), filename=str(path)), paths):
            parts = imported.split(".")
            targets.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
        graph[name] = {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def collapse(graph: Mapping[str, Collection[str]], unit: Callable[[str], str | None]) -> dict[str, set[str]]:
    """The graph between units (``unit(module)``; None: left out), without a unit's edges to itself."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = unit(module)
        if source is not None:
            units.setdefault(source, set()).update(t for t in map(unit, targets) if t not in (None, source))
    return units


def find_cycle(graph: Mapping[str, Collection[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]`` (each imports the next), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                done.add(path.pop())
                stack.pop()
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done and child in graph:
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def _cycle_text(cycle: list[str] | None) -> str:
    return "no cycle" if cycle is None else "import cycle: " + " -> ".join(cycle)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer, None for a module in none."""
    found = [
        (len(name), index)
        for index, (_, names) in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    return max(found)[1] if found else None


def folder_unit(modules: Collection[str]) -> Callable[[str], str]:
    """A module's unit of the folder check: its folder (a package's ``__init__``: the package), or the
    module itself where its folder also holds subpackages."""
    packages = {m for m in modules if any(other.startswith(m + ".") for other in modules)}
    with_subpackages = {p.rpartition(".")[0] for p in packages}

    def unit(module: str) -> str:
        if module in packages:
            return module
        folder = module.rpartition(".")[0]
        return module if folder in with_subpackages else folder

    return unit


@functools.cache
def _project_graph() -> dict[str, frozenset[str]]:
    graph = import_graph(ROOT, "geofm", *PROGRAMS)
    return {module: frozenset(targets) for module, targets in graph.items()}


def test_project_modules_import_no_cycle():
    cycle = find_cycle(_project_graph())
    assert cycle is None, _cycle_text(cycle)


def test_project_folders_import_no_cycle():
    graph = _project_graph()
    folders = collapse(graph, folder_unit(graph))
    assert find_cycle(folders) is None, _cycle_text(find_cycle(folders))


def test_every_module_stands_on_a_layer():
    assert [m for m in _project_graph() if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in sorted(_project_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == [], "\n".join(upward)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files, cycle",
    [
        ({"a.py": "import pkg.b\n", "b.py": "from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        (  # closed inside a function: counted
            {"a.py": "import pkg.b\n", "b.py": "def f():\n    from pkg.a import x\n"},
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        (  # through the __init__ of the imported module's package
            {"a.py": "import pkg.sub.c\n", "sub/__init__.py": "import pkg.a\n", "sub/c.py": ""},
            ["pkg.a", "pkg.sub", "pkg.a"],
        ),
        (
            {
                "a.py": "import pkg.b\n",
                "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
            },
            None,
        ),
        ({"a.py": "import pkg.b\n", "b.py": "REGISTERED = 'pkg.a:x'\n"}, None),
    ],
    ids=["module level", "in a function", "package init", "type checking only", "registry string"],
)
def test_the_cycle_check_finds_cycles_in_a_made_up_package(tmp_path, files, cycle):
    _write_package(tmp_path / "pkg", {"__init__.py": "", **files})
    assert find_cycle(import_graph(tmp_path, "pkg")) == cycle


def test_the_package_check_finds_a_cycle_between_packages(tmp_path):
    _write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "x/__init__.py": "",
            "x/one.py": "import pkg.y.two\n",
            "y/__init__.py": "",
            "y/two.py": "",
            "y/three.py": "def f():\n    import pkg.x.one\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert find_cycle(graph) is None, "no cycle between modules"
    assert find_cycle(collapse(graph, folder_unit(graph))) == ["pkg.x", "pkg.y", "pkg.x"]


def test_the_cycle_check_finds_a_cycle_between_two_packages(tmp_path):
    _write_package(tmp_path / "low", {"__init__.py": "", "task.py": "def run():\n    import high.program\n"})
    _write_package(tmp_path / "high", {"__init__.py": "", "program.py": "from low.task import run\n"})
    assert find_cycle(import_graph(tmp_path, "low")) is None, "each package alone has none"
    assert find_cycle(import_graph(tmp_path, "high", "low")) == ["high.program", "low.task", "high.program"]


def test_a_module_beside_subpackages_is_a_unit_of_its_own(tmp_path):
    _write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "low.py": "",
            "high.py": "import pkg.sub.one\n",
            "sub/__init__.py": "",
            "sub/one.py": "import pkg.low\n",
            "sub/two.py": "",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    unit = folder_unit(graph)
    assert [unit(m) for m in ("pkg", "pkg.low", "pkg.sub", "pkg.sub.one", "pkg.sub.two")] == [
        "pkg",
        "pkg.low",
        "pkg.sub",
        "pkg.sub",
        "pkg.sub",
    ]
    assert find_cycle(collapse(graph, unit)) is None, "pkg.high -> pkg.sub -> pkg.low is layered"


def test_the_layer_check_places_a_module_by_its_longest_name():
    assert LAYERS[layer_of("geofm.tasks")][0] == "foundations"
    assert LAYERS[layer_of("geofm.tasks.mim.loss")][0] == "objectives"
    assert LAYERS[layer_of("federation.programs.server")][0] == "programs"
    assert layer_of("elsewhere") is None
