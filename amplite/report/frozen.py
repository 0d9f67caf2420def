"""Read-only JSON trees: what :attr:`amplite.report.document.Report.data` and the report sections hold.

A :class:`FrozenDict` / :class:`FrozenList` is a ``dict`` / ``list`` (so ``json.dumps``, ``==`` and
``isinstance`` work as for the plain types) that refuses every change with a :class:`TypeError`. Copies
(``copy.copy``, ``copy.deepcopy``, :func:`thaw`) are plain, writable dicts and lists.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

__all__ = ["FrozenDict", "FrozenList", "freeze", "thaw"]

_WHY = "a report is read-only: Report.with_sections(...) makes a new report (amplite/report/document.py)"


def _refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(_WHY)


class FrozenDict(dict):
    """A ``dict`` that cannot be changed."""

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


class FrozenList(list):
    """A ``list`` that cannot be changed."""

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(v, memo) for v in self]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))


def freeze(tree: Any) -> Any:
    """A read-only copy of a JSON-like tree: dicts as :class:`FrozenDict`, lists and tuples as :class:`FrozenList`."""
    if isinstance(tree, dict):
        return tree if type(tree) is FrozenDict else FrozenDict((k, freeze(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return tree if type(tree) is FrozenList else FrozenList(freeze(v) for v in tree)
    return tree


def thaw(tree: Any) -> Any:
    """A plain, writable deep copy of a (frozen) JSON-like tree."""
    if isinstance(tree, dict):
        return {k: thaw(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [thaw(v) for v in tree]
    return tree
