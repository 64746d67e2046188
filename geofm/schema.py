"""Reading pydantic models as config schemas: the section a field path leads to, and the message of a
key that no section or registry entry's ``Options`` model has, with the keys it may have meant."""

from __future__ import annotations

import collections.abc
import difflib
import typing
from typing import Any

from pydantic import BaseModel


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds, itself or as the items of a list or an optional value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (dict, collections.abc.Mapping):
        return None
    return next(filter(None, map(section_of, typing.get_args(annotation))), None)


def section_at(schema: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The section at ``loc`` (a pydantic error's location); None when the path leaves plain sections and lists."""
    section: type[BaseModel] | None = schema
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections
            continue
        field = section.model_fields.get(part) if section is not None else None
        section = section_of(field.annotation) if field is not None else None
    return section


def unknown_key(schema: type[BaseModel], loc: tuple) -> str:
    """The message of the unknown key at ``loc`` (the last part) of ``schema``, with the nearest keys its
    section has."""
    section = section_at(schema, loc[:-1])
    keys = list(section.model_fields) if section is not None else []
    near = difflib.get_close_matches(str(loc[-1]), keys, n=2, cutoff=0.6)
    return f"unknown key (did you mean {' or '.join(near)}?)" if near else "unknown key"
