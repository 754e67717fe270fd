"""What the typed models (msgspec Structs) share: reading a validation error, a model's field metadata.

Our models are ``msgspec.Struct`` classes: protocol messages, preferences, the catalog, the swarm
summary. Constraints are ``msgspec.Meta`` annotations and are checked when data is decoded or
converted (``msgspec.convert``), not when a model is built in code; checks that need code are in
``__post_init__``, which runs both ways. ``problem`` turns msgspec's ``ValidationError`` into the
field path and the reason that our messages show (``experiments[1].hardware.cpu_cores: required
field missing``). ``fields`` gives a model's field titles, help texts and ranges (the app's form).

Light: msgspec and the standard library only (no pydantic: the tray app imports this).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

__all__ = ["Field", "coerce_floats", "describe", "fields", "problem"]

_NAMED = re.compile(r"^Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]*)`$")


def problem(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(field path, reason) of a validation error: ``("experiments[1].hardware.cpu_cores",
    "required field missing")``; the path is ``""`` when the whole document is wrong."""
    text = str(exc)
    reason, sep, path = text.rpartition(" - at `$")
    if not sep or not path.endswith("`"):
        reason, path = text, ""
    else:
        path = path[:-1].removeprefix(".")
    named = _NAMED.match(reason)
    if named:
        name = named["name"]
        path = f"{path}.{name}" if path else name
        reason = "required field missing" if named["what"] == "missing required" else "unknown field"
    return path, reason


def describe(exc: msgspec.ValidationError, whole: str = "") -> str:
    """``path: reason`` (``whole: reason`` when the path is empty and ``whole`` is given)."""
    path, reason = problem(exc)
    path = path or whole
    return f"{path}: {reason}" if path else reason


@dataclass(frozen=True)
class Field:
    """One field of a model: its type without constraints (``int | None``), default, title, help, range."""

    name: str
    annotation: Any
    default: Any
    title: str | None = None
    description: str | None = None
    ge: float | None = None
    le: float | None = None


def _metas(hint: Any) -> list[msgspec.Meta]:
    """The ``msgspec.Meta`` annotations of a type hint, also inside ``X | None``."""
    if typing.get_origin(hint) is Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, msgspec.Meta)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [m for arg in typing.get_args(hint) for m in _metas(arg)]
    return []


@functools.cache
def fields(model: type[msgspec.Struct]) -> dict[str, Field]:
    """The fields of ``model`` in order, with what their ``msgspec.Meta`` says."""
    plain = typing.get_type_hints(model)
    full = typing.get_type_hints(model, include_extras=True)
    out = {}
    for info in msgspec.structs.fields(model):
        metas = _metas(full[info.name])

        def first(attr: str, metas: list[msgspec.Meta] = metas) -> Any:
            return next((getattr(m, attr) for m in metas if getattr(m, attr) is not None), None)

        default = info.default if info.default is not msgspec.NODEFAULT else (
            info.default_factory() if info.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        out[info.name] = Field(info.name, plain[info.name], default, first("title"), first("description"),
                               first("ge"), first("le"))
    return out


@functools.cache
def _float_fields(model: type[msgspec.Struct]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(model).values() if f.annotation in (float, float | None))


def coerce_floats(obj: msgspec.Struct) -> None:
    """Make the float fields of ``obj`` floats (``5`` -> ``5.0``, a numpy float -> ``float``), as
    decoding does, so that a model built in code writes the same JSON as one read back. For
    ``__post_init__``."""
    for name in _float_fields(type(obj)):
        value = getattr(obj, name)
        if value is not None and type(value) is not float:
            msgspec.structs.force_setattr(obj, name, float(value))
