"""Typed, frozen JSON records: the base of every report section and of the entries inside one.

A :class:`Record` is a frozen dataclass whose fields are the keys of one JSON object, declared with their
types (``float | str`` for a report number, which may be ``"inf"``/``"-inf"``/``"nan"``:
:mod:`amplite.verify.numbers`). :meth:`Record.from_json` reads the object, :meth:`Record.to_json` writes it
back: a field typed as a record (or a tuple of records) is read into that type; lists and dicts of plain
values are kept read-only (:mod:`amplite.report.frozen`). Reading is lossless, so a report written by an older
or newer amplite reads back and writes out the same document:

- a key the record does not declare is kept in ``rest`` (written after the declared ones);
- the keys are written back in the order they were read, and a field the object did not have stays absent;
- a value of the wrong JSON type is kept as it is (never coerced), so the schema check of the one writer
  (:func:`amplite.report.schema.write_report`) names it, instead of a reader guessing.

A :class:`Section` is a record that is one top-level key of report.json (``key``); :class:`ListSection` and
:class:`MapSection` are the sections whose JSON is a list of entries or a map of plain values.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar, TypeVar

from amplite.report.frozen import FrozenDict, freeze, thaw

__all__ = ["Entry", "ListSection", "MapSection", "Num", "Record", "Section"]

#: A report number: a float, or ``"inf"``/``"-inf"``/``"nan"`` (:func:`amplite.verify.numbers.decode_float`).
Num = float | str
R = TypeVar("R", bound="Record")
_RESERVED = ("rest", "read_order")


@dataclass(frozen=True, kw_only=True)
class Record:
    """A typed, read-only JSON object (see the module docstring).

    Attributes:
        rest: Keys this record does not declare, with their (read-only) values.
        read_order: The keys in the order they were read (None: built in code, declared order).
    """

    rest: Mapping[str, Any] = field(default_factory=FrozenDict)
    read_order: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rest", freeze(dict(self.rest)))
        for name, kind in _kinds(type(self)).items():
            value = getattr(self, name)
            if kind is None and isinstance(value, (dict, list, tuple)):  # plain JSON: read-only
                object.__setattr__(self, name, freeze(value))

    @classmethod
    def from_json(cls: type[R], value: Mapping[str, Any]) -> R:
        """The record of a JSON object (keys it does not declare go to ``rest``)."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{cls.__name__} reads a JSON object, not {type(value).__name__}")
        kinds = _kinds(cls)
        known = {k: _read(kinds[k], v) for k, v in value.items() if k in kinds}
        rest = {k: v for k, v in value.items() if k not in kinds}
        return cls(**known, rest=rest, read_order=tuple(value))

    def to_json(self) -> dict[str, Any]:
        """The JSON object: a plain, writable copy (absent fields left out, ``rest`` after the declared keys)."""
        kinds = _kinds(type(self))
        if self.read_order is not None:
            order = [k for k in self.read_order if k in kinds or k in self.rest]
            order += [k for k in kinds if k not in order and getattr(self, k) is not None]  # set after reading
        else:
            order = [k for k in kinds if getattr(self, k) is not None] + list(self.rest)
        return {k: _write(getattr(self, k)) if k in kinds else thaw(self.rest[k]) for k in order}

    def __copy__(self) -> Record:
        return self  # immutable: a copy is the record itself

    def __deepcopy__(self, memo: dict[int, Any]) -> Record:
        return self


class Entry(Record):
    """An entry inside a section (an output's metrics, a plan entry, a budget step...)."""


@dataclass(frozen=True, kw_only=True)
class Section(Record):
    """One top-level key of report.json (``key``) and its typed value.

    ``of(...)`` builds a section from the values amplite already has; the default reads its JSON value.
    """

    key: ClassVar[str]

    @classmethod
    def of(cls: type[R], value: Any) -> R:
        """The section from its JSON value."""
        return cls.from_json(value)

    @cached_property
    def value(self) -> Any:
        """The section's JSON value, read-only (what ``report.data[key]`` holds)."""
        return freeze(self.to_json())


@dataclass(frozen=True, kw_only=True)
class ListSection(Section):
    """A section whose JSON is a list; ``items`` holds the entries (typed when ``item`` is a record)."""

    item: ClassVar[type | None] = None
    items: tuple[Any, ...] = ()

    @classmethod
    def from_json(cls: type[R], value: Iterable[Any]) -> R:  # type: ignore[override]
        item = cls.item  # type: ignore[attr-defined]
        if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
            return cls(items=value)  # type: ignore[call-arg]  # the schema check names it on write
        read = item.from_json if isinstance(item, type) and issubclass(item, Record) else freeze
        return cls(items=tuple(read(v) if isinstance(v, Mapping) or item is None else v for v in value))  # type: ignore[call-arg]

    def to_json(self) -> Any:  # type: ignore[override]
        return _write(self.items)

    def __iter__(self) -> Any:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, kw_only=True)
class MapSection(Section):
    """A section whose JSON is a map of plain values (``values``: key -> value)."""

    values: Mapping[str, Any] = field(default_factory=FrozenDict)  # frozen by Record.__post_init__

    @classmethod
    def from_json(cls: type[R], value: Mapping[str, Any]) -> R:  # type: ignore[override]
        return cls(values=value)  # type: ignore[call-arg]

    def to_json(self) -> Any:  # type: ignore[override]
        return thaw(self.values)


def _record_type(hint: Any) -> tuple[type[Record] | None, bool]:
    """(the record type a field holds, whether it is a tuple of them) from its type hint."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in args:
            found = _record_type(arg)
            if found[0] is not None:
                return found
        return None, False
    if typing.get_origin(hint) is tuple and args and isinstance(args[0], type) and issubclass(args[0], Record):
        return args[0], True
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint, False
    return None, False


@functools.cache
def _kinds(cls: type[Record]) -> dict[str, tuple[type[Record], bool] | None]:
    """A record's declared JSON keys, in order, each with the record type it holds (None: plain JSON)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type[Record], bool] | None] = {}
    for f in fields(cls):
        if f.name in _RESERVED or not f.init:
            continue
        rec, many = _record_type(hints[f.name])
        out[f.name] = (rec, many) if rec is not None else None
    return out


def _read(kind: tuple[type[Record], bool] | None, value: Any) -> Any:
    if kind is None:
        return value
    rec, many = kind
    if many and isinstance(value, list):
        return tuple(rec.from_json(v) if isinstance(v, Mapping) else v for v in value)
    if not many and isinstance(value, Mapping):
        return rec.from_json(value)
    return value  # the wrong JSON type: kept, for the schema check to name


def _write(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_write(v) for v in value]
    return thaw(value)
