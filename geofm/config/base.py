"""Reading a config: YAML plus ``key.path=value`` overrides, validated against one program's schema.

Every program (central pretraining, federated pretraining, finetuning) has one typed schema built
from the shared sections of :mod:`geofm.config.sections`. Unknown keys, wrong types and impossible
combinations raise a single :class:`~geofm.errors.ConfigError` that names the file and every
offending field, before any work starts.

Relative paths in a config are resolved against the working directory (the shipped configs are
written to be run from the repository root); errors about paths show the resolved absolute path.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo

from geofm.errors import ConfigError
from geofm.schema import section_at, unknown_key

FORM_ONLY = {"check_architecture": False}
"""The validation context of the first pass: keys and values only, no check that builds an architecture."""
CONFIG_FILE = "config.yaml"
"""The validated config a run keeps in its directory."""


MovedKeys = dict[str, tuple[tuple[str, ...], str, Any]]
"""Keys a section had before its entries kept their settings in ``options``: each key -> the entries
that read it, its name in their ``options``, its default then."""


def refuse_moved_keys(data: Any, moved: typing.Mapping[str, str], whose: str) -> Any:
    """``data``, a section's raw mapping, unless it sets a key that has moved into the section's
    ``options`` (``moved``: old key -> its name there); ValueError naming each and where it goes.

    Args:
        whose: whose settings they are and where they go (``"an algorithm's own settings go in algorithm.options"``).
    """
    keys = [key for key in moved if isinstance(data, dict) and key in data]
    if keys:
        raise ValueError(
            f"{', '.join(keys)}: {whose}; write options: {{{', '.join(f'{moved[key]}: ...' for key in keys)}}}"
        )
    return data


def checks_architecture(info: ValidationInfo) -> bool:
    """Whether a validator runs its checks that build the backbone's architecture (importing timm and torch).

    :meth:`ProgramConfig.from_tree` first validates without them, so that a config with errors of
    its own keys and values is refused without loading the deep-learning stack.
    """
    return (info.context or {}).get("check_architecture", True)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; values are type-checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _child(node: Any, key: str, dotted: str, where: str, source: str) -> Any:
    """The entry ``key`` of a mapping or (by index) a list, for an override path."""
    if isinstance(node, list):
        if not key.lstrip("-").isdigit() or not -len(node) <= int(key) < len(node):
            raise ConfigError(
                f"{source}: override {dotted!r}: {where} is a list of {len(node)} entries; {key!r} is not an index of it"
            )
        return node[int(key)]
    return node.get(key)


def set_dotted(tree: dict, dotted: str, value: Any, source: str = "<config>") -> None:
    """Set ``value`` at ``dotted`` (``train.epochs``, ``data.sources.0.root``) inside a parsed config.

    Missing sections are created; list entries are addressed by their index. A mapping merges into
    the mapping already there, as a ``base:`` file's does (:func:`_merged`).

    Raises:
        ConfigError: when the path runs through a value that is neither a section nor a list.
    """
    keys = dotted.split(".")
    node: Any = tree
    for depth, key in enumerate(keys[:-1]):
        where = ".".join(keys[: depth + 1])
        child = _child(node, key, dotted, ".".join(keys[:depth]) or "the config", source)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"{source}: override {dotted!r}: {where} is not a section")
        node = child
    last = keys[-1]
    if isinstance(node, list):
        _child(node, last, dotted, ".".join(keys[:-1]), source)
        node[int(last)] = _merged(node[int(last)], value)
    else:
        node[last] = _merged(node.get(last), value)


class Replace(dict):
    """A mapping written ``!replace {...}``: it replaces the mapping beneath it instead of merging into it."""


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader plus the ``!replace`` tag."""


def _replace(loader: _ConfigLoader, node: yaml.Node) -> Any:
    """A value written ``!replace``: a mapping as :class:`Replace`; a list or a scalar as it is, as it
    replaces whatever is beneath it anyway (:func:`_merged`)."""
    if isinstance(node, yaml.MappingNode):
        return Replace(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    untagged = loader.resolve(yaml.ScalarNode, node.value, (True, False))
    return loader.construct_object(yaml.ScalarNode(untagged, node.value, node.start_mark, node.end_mark), deep=True)


_ConfigLoader.add_constructor("!replace", _replace)


def load_yaml(text: str) -> Any:
    """YAML as configs and overrides are read (``!replace`` marks a mapping that replaces, see :func:`_merged`)."""
    return yaml.load(text, Loader=_ConfigLoader)


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Turn ``["train.epochs=3", "teacher=null"]`` into (key, YAML-parsed value) pairs.

    Raises:
        ConfigError: an override without ``=``, or whose value is not valid YAML.
    """
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            pairs.append((key.strip(), load_yaml(raw)))
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc})") from None
    return pairs


def _required_leaves(section: type[BaseModel], where: str) -> list[str]:
    """The paths of the values a missing section at ``where`` needs (a section it needs: its values)."""
    leaves = []
    for name, field in section.model_fields.items():
        if field.is_required():
            nested = field.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                leaves += _required_leaves(nested, f"{where}.{name}")
            else:
                leaves.append(f"{where}.{name}")
    return leaves or [where]


class _Problem(typing.NamedTuple):
    """One invalid field: its dotted path, what names it beside the path (a source's name), what is wrong."""

    field: str
    aside: str
    message: str


def _problems(err: ValidationError, schema: type[BaseModel]) -> list[_Problem]:
    """Each error of ``err`` as a :class:`_Problem`, its field's path said once."""
    problems = []
    for e in err.errors():
        loc = e["loc"]
        where = ".".join(str(p) for p in loc) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            parent = section_at(schema, loc[:-1])
            field = parent.model_fields.get(str(loc[-1])) if parent is not None and loc else None
            missing = field.annotation if field is not None else None
            if isinstance(missing, type) and issubclass(missing, BaseModel):
                problems += [_Problem(leaf, "", msg) for leaf in _required_leaves(missing, where)]
                continue
        elif e["type"] == "extra_forbidden":
            msg = unknown_key(schema, loc)
        elif not isinstance(e.get("input"), dict):
            msg = f"{msg} (got {e.get('input')!r})"
        problems.append(_named_field(msg, loc, schema) or _Problem(where, "", msg))
    return problems


def _named_field(msg: str, loc: tuple, schema: type[BaseModel]) -> _Problem | None:
    """The problem a section's check at ``loc`` names by its field, whole (``data.bands: ...``) or below
    the section (``options.teacher_tmp: ...`` in ``algorithm``'s check), rather than the section itself."""
    named = re.match(r"([\w.]+)((?: \([^)]*\))?): (.*)", msg, re.DOTALL)
    if named is None:
        return None
    where, path = ".".join(map(str, loc)), named[1]
    section = section_at(schema, loc)
    if not path.startswith(f"{where}.") or not loc:
        if section is None or path.split(".")[0] not in section.model_fields:
            return None
        path = f"{where}.{path}" if loc else path
    return _Problem(path, named[2], named[3])


def _override_of(field: str, overrides: Sequence[str]) -> tuple[str, str] | None:
    """The command-line override that set ``field`` (the last, as it wins) and its key; None when the file did."""
    for item, (key, value) in reversed(list(zip(overrides, parse_overrides(overrides), strict=True))):
        below = field.removeprefix(f"{key}.")
        if field == key or key.startswith(f"{field}.") or (below != field and _holds(value, below.split("."))):
            return item, key
    return None


def _holds(value: Any, path: list[str]) -> bool:
    """Whether a parsed override value holds ``path`` (keys of mappings, indices of lists)."""
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return False
    return True


def _validation_error(err: ValidationError, schema: type[BaseModel], source: str, overrides: Sequence[str]) -> str:
    """The message of a config that failed validation: each wrong field once, an override's by the override."""
    lines, from_file = [], False
    for field, aside, message in _problems(err, schema):
        override = _override_of(field, overrides)
        from_file |= override is None
        if override is None:
            lines.append(f"  {field}{aside}: {message}")
        elif field == override[1]:
            lines.append(f"  override {override[0]}{aside}: {message}")
        else:
            lines.append(f"  override {override[0]}: {field}{aside}: {message}")
    head = f"{source}: invalid configuration" if from_file else f"the overrides of {source} are invalid"
    return "\n".join([head, *lines])


BASE_KEY = "base"


def _merged(base: Any, override: Any) -> Any:
    """``override`` on top of ``base``, as both ``base:`` files and command-line overrides combine.

    Mappings merge key by key; anything else (lists too, with or without ``!replace``) is replaced, and so
    is a mapping written ``!replace {...}`` (an empty mapping ``{}`` clears the one beneath it).
    """
    if not (isinstance(override, dict) and override and isinstance(base, dict)) or isinstance(override, Replace):
        return _plain(override)
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merged(merged.get(key), value)
    return merged


def _plain(value: Any) -> Any:
    """``value`` with every :class:`Replace` mapping turned into a plain dict (the marker has done its work)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _read_yaml_tree(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A YAML file's mapping, on top of the file its ``base`` key names (relative to the file), recursively."""
    if not path.is_file():
        raise ConfigError(f"config file {path.resolve()} does not exist" + (f" (base of {chain[-1]})" if chain else ""))
    if path.resolve() in chain:
        raise ConfigError(f"{path}: base configs form a cycle: {' -> '.join(str(p) for p in (*chain, path.resolve()))}")
    try:
        tree = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = tree.pop(BASE_KEY, None)
    if base is None:
        return _plain(tree)
    return _merged(_read_yaml_tree(path.parent / str(base), (*chain, path.resolve())), tree)


def read_config_tree(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The parsed mapping of a config file with the overrides applied (not yet validated).

    A file may start from another: ``base: other.yaml`` (relative to the file) is read first and
    the file's own keys are merged on top of it, so a baseline or an ablation is a few lines over
    the setting it varies. Overrides combine with the tree the same way: a mapping value merges into
    the mapping at its path (``data.kwargs={split: val}`` changes one argument), any other value
    replaces, and ``!replace {...}`` (or ``{}``, which clears) replaces a mapping whole, in a file
    and on the command line alike.
    """
    path = Path(path)
    tree = _read_yaml_tree(path)
    for key, value in parse_overrides(overrides):
        set_dotted(tree, key, value, str(path))
    return tree


class ProgramConfig(Section):
    """The whole config of one program; read it with :meth:`from_file` or :meth:`from_tree`."""

    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Self:
        """Read a YAML config, apply ``key.path=value`` overrides (values parsed as YAML) and validate it.

        Raises:
            ConfigError: naming the file and every invalid field (the override that set it, if one did).
        """
        return cls.from_tree(read_config_tree(path, overrides), str(path), overrides)

    @classmethod
    def from_tree(cls, tree: dict, source: str = "<config>", overrides: Sequence[str] = ()) -> Self:
        """Validate an already-parsed config tree; ``source`` names it in errors, and ``overrides`` (those
        :func:`read_config_tree` applied to it) name the fields they set.

        Keys and values are checked first; the checks that need the backbone's architecture (timm)
        run once they pass.
        """
        try:
            cls.model_validate(tree, context=FORM_ONLY)
            return cls.model_validate(tree)
        except ValidationError as exc:
            raise ConfigError(_validation_error(exc, cls, source, overrides)) from None


def config_to_dict(cfg: Section) -> dict:
    """JSON-ready dict of a config (paths as strings), for run directories and sidecars."""
    return cfg.model_dump(mode="json")
