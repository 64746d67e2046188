"""Named registries users extend, in the style of timm's ``register_model`` and torchgeo's ``get_model``.

A :class:`Registry` maps a name to an object (a class, a factory). Built-in entries are registered
lazily as ``"package.module:attribute"`` strings, so that listing names imports nothing; a
decorator registers an object defined in code; and a third-party package adds entries without
editing geofm through an entry point of the registry's group::

    # the plug-in's pyproject.toml
    [project.entry-points."geofm.algorithms"]
    fedfancy = "fancy_fl.algorithm:FedFancy"

Only registered names can be loaded: a config names an entry, never an import path, so a node of
a federation imports only modules its installation registered. An unknown name is an error that
lists the nearest registered names.

Every entry has the same shape: its name, its own settings as an ``Options`` pydantic model (an
attribute of the entry; none where it takes none), read from the ``options`` of the config section
that names it (:meth:`Registry.options`), and its rules on the rest of the config (a ``check``).
``geofm list KIND`` prints a registry's names with the first paragraph of each entry's docstring
(:meth:`Registry.summary`, read from the source of a lazy entry) and each entry's options.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofm.errors import ConfigError

if TYPE_CHECKING:  # pydantic is imported when options are validated: the GPU device check reads tasks without it
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo


class Registry[T]:
    """Names to objects of one kind.

    Args:
        kind: what the entries are, for messages (``"algorithm"``).
        group: the entry-point group third-party packages register in (``"geofm.algorithms"``).
    """

    def __init__(self, kind: str, group: str) -> None:
        self.kind, self.group = kind, group
        self._entries: dict[str, T | str] = {}
        self._entry_points_read = False

    def register(self, name: str, target: T | str | None = None) -> Callable[[T], T] | T | str:
        """Register ``target`` (an object, or a lazy ``"module:attribute"``) under ``name``.

        Without ``target`` it is a decorator: ``@ALGORITHMS.register("fedavg")``. Registering a
        name again replaces the entry (a plug-in may override a built-in on purpose).
        """
        if target is None:

            def decorate(obj: T) -> T:
                self._entries[name] = obj
                return obj

            return decorate
        if isinstance(target, str) and target.count(":") != 1:
            raise ValueError(f"{self.kind} {name!r}: a lazy entry is 'package.module:attribute', got {target!r}")
        self._entries[name] = target
        return target

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` (a test's own entry, once the test is done).

        Raises:
            ConfigError: ``name`` is not registered (listing the nearest names).
        """
        if name not in self:
            raise ConfigError(self.unknown(name))
        del self._entries[name]

    def _read_entry_points(self) -> None:
        if self._entry_points_read:
            return
        self._entry_points_read = True
        for point in entry_points(group=self.group):
            self._entries.setdefault(point.name, point.value)

    def names(self) -> list[str]:
        """Every registered name, built-in and from installed plug-ins, sorted."""
        self._read_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered, with the nearest registered names."""
        names = self.names()
        close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(names)})"

    def check(self, name: object) -> str:
        """``name`` if it is registered (for config validators), else ValueError with the nearest names."""
        if name not in self:
            raise ValueError(self.unknown(name))
        return str(name)

    def get(self, name: str) -> T:
        """The object registered as ``name``, importing its module on first use.

        Raises:
            ConfigError: ``name`` is not registered (listing the nearest names), or its module
                cannot be imported or lacks the attribute.
        """
        if name not in self:
            raise ConfigError(self.unknown(name))
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, attribute = entry.split(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                raise ConfigError(f"{self.kind} {name!r}: cannot import {module_name!r} ({err})") from err
            if not hasattr(module, attribute):
                raise ConfigError(f"{self.kind} {name!r}: module {module_name!r} has no attribute {attribute!r}")
            entry = self._entries[name] = getattr(module, attribute)
        return entry

    def options_model(self, name: str) -> type[BaseModel] | None:
        """The pydantic model of the entry's own settings (its ``Options`` attribute); None where it takes none.

        Raises:
            ConfigError: as :meth:`get`.
        """
        return getattr(self.get(name), "Options", None)

    def options(self, name: str, given: Mapping[str, Any], where: str) -> BaseModel | None:
        """The settings ``given`` to entry ``name`` validated by its :meth:`options_model` (see
        :func:`entry_options`)."""
        return entry_options(name, self.options_model(name), given, where)

    def option_rows(self, name: str) -> list[tuple[str, str, str, str]]:
        """The entry's options as (field, type, default, description) rows, for ``geofm list``.

        Raises:
            ConfigError: as :meth:`get`.
        """
        model = self.options_model(name)
        if model is None:
            return []
        return [
            (field, _type_name(info.annotation), _default_text(info), info.description or "")
            for field, info in model.model_fields.items()
        ]

    def summary(self, name: str) -> str:
        """The first paragraph of the entry's docstring on one line, literals in single backquotes (empty
        without one).

        A lazy entry's docstring is read from its module's source, so that listing imports none
        of the entries' modules.

        Raises:
            ConfigError: ``name`` is not registered (listing the nearest names).
        """
        if name not in self:
            raise ConfigError(self.unknown(name))
        entry = self._entries[name]
        doc = _source_docstring(entry) if isinstance(entry, str) else inspect.getdoc(entry)
        return " ".join((doc or "").split("\n\n")[0].split()).replace("``", "`")


def validated(model: type[BaseModel], data: Any, where: str, context: dict | None = None) -> BaseModel:
    """``data`` validated as ``model`` (``context``: pydantic's validation context); ValueError naming
    ``where``, the first bad field and what it expects (an unknown key: the keys it may have meant)."""
    from pydantic import ValidationError

    from geofm.schema import unknown_key

    try:
        return model.model_validate(data, context=context)
    except ValidationError as err:
        # An unknown key first: a misspelt required key is "missing" too, and the typo is the cause.
        first = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
        loc = ".".join(str(part) for part in first["loc"])
        message = (
            unknown_key(model, first["loc"])
            if first["type"] == "extra_forbidden"
            else first["msg"].removeprefix("Value error, ")
        )
        raise ValueError(f"{where}{'.' + loc if loc else ''}: {message}") from None


def entry_options(
    name: str, model: type[BaseModel] | None, given: Mapping[str, Any], where: str, context: dict | None = None
) -> BaseModel | None:
    """``given`` (the ``options`` of a config section) validated by ``model``, the options model of
    the entry ``name`` (``context``: pydantic's validation context); None for an entry that takes none
    and was given none.

    Raises:
        ValueError: naming ``where`` and the bad field, or the entry that takes no options.
    """
    if model is None:
        if given:
            raise ValueError(f"{where}: {name} takes no options, got {sorted(given)}")
        return None
    return validated(model, dict(given), where, context)


def _type_name(annotation: Any) -> str:
    """A field's type as written in code: ``int``, ``list[int] | None``, ``Literal['a', 'b']``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _default_text(info: FieldInfo) -> str:
    """A field's default as a config would write it, or ``required``."""
    return "required" if info.is_required() else repr(info.get_default(call_default_factory=True))


def _source_docstring(entry: str) -> str | None:
    """The docstring of a lazy entry's class or function, or of its variable (the string after the
    assignment, else, for an instance of a class of the module, that class's, as ``inspect.getdoc``
    gives once it is imported), read from the module's source; None where there is none or no source."""
    module_name, attribute = entry.split(":")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    body = ast.parse(Path(spec.origin).read_text()).body
    for node, following in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attribute:
            return ast.get_docstring(node)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(target, ast.Name) and target.id == attribute for target in targets):
            text = (
                following.value.value
                if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                else None
            )
            if isinstance(text, str):
                return inspect.cleandoc(text)
            value = getattr(node, "value", None)
            called = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
            classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == called]
            return ast.get_docstring(classes[0]) if classes else None
    return None


REGISTRIES: Registry[Registry] = Registry("registry", "geofm.registries")
"""The registries users extend, by the name ``geofm list`` takes; a plug-in adds its own through the
``geofm.registries`` entry-point group."""
REGISTRIES.register("algorithms", "geofm.fl.algorithms:ALGORITHMS")
REGISTRIES.register("aggregators", "geofm.fl.aggregation.robust:AGGREGATORS")
REGISTRIES.register("central-programs", "geofm.tasks:CENTRAL_PROGRAMS")
REGISTRIES.register("checkpoint-layouts", "geofm.checkpoints.layouts:CHECKPOINT_LAYOUTS")
REGISTRIES.register("federated-configs", "geofm.tasks:FEDERATED_CONFIGS")
REGISTRIES.register("federated-tasks", "geofm.tasks:FEDERATED_TASKS")
REGISTRIES.register("folder-layouts", "geofm.data.layouts:FOLDER_LAYOUTS")
REGISTRIES.register("heads", "geofm.models.heads:HEADS")
REGISTRIES.register("partitioners", "geofm.fl.partitions.files:PARTITIONERS")
REGISTRIES.register("product-layouts", "geofm.data.layouts:PRODUCT_LAYOUTS")
REGISTRIES.register("programs", "federation.runtime.contract:PROGRAMS")
REGISTRIES.register("sample-partitioners", "geofm.fl.partitions.samples:SAMPLE_PARTITIONERS")
REGISTRIES.register("server-optimizers", "geofm.fl.aggregation.server_optimizers:SERVER_OPTIMIZERS")
REGISTRIES.register("tasks", "geofm.tasks:TASKS")


__all__ = ["REGISTRIES", "Registry", "entry_options"]
