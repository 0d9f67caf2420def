"""Where a key of a batch manifest is written: line numbers for the one-line errors that name them.

:func:`line_index` finds the section headers of the TOML text once; :func:`combined` answers for one
``[[model]]`` entry with ``[defaults]`` behind it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def line_index(text: str) -> Any:
    """``finder(model_index)``: a function key -> line number of ``key`` in ``[defaults]`` (index None) or the
    n-th ``[[model]]``. The text is split and its section headers found once (linear in the manifest's size,
    whatever the number of entries).

    A dotted key (``tolerance.min_cosine``) is looked up in the entry's sub-table (``[model.tolerance]``)
    when it has one, else on the line of its inline table.
    """
    lines = text.splitlines()
    sections: list[tuple[str, int]] = []  # (header, 1-based line), in file order
    for i, raw in enumerate(lines, 1):
        m = re.match(r"^\s*\[\[?\s*([\w.\"' -]+?)\s*\]\]?", raw)
        if m and not re.match(r"^\s*[\w\"'.-]+\s*=", raw):
            sections.append((re.sub(r"[\"'\s]", "", m.group(1)), i))
    starts: dict[str, list[int]] = {}  # header -> indexes into sections
    for k, (name, _) in enumerate(sections):
        starts.setdefault(name, []).append(k)

    def search(key: str, lo: int, hi: int) -> int | None:
        pat = re.compile(r"(^|[\s{,.])[\"']?" + re.escape(key) + r"[\"']?\s*=")
        return next((ln for ln in range(lo, hi) if pat.search(lines[ln - 1].split("#", 1)[0])), None)

    def finder(model_index: int | None) -> Any:
        wanted = "defaults" if model_index is None else "model"
        pick = 0 if model_index is None else model_index
        mine = starts.get(wanted, [])
        if pick >= len(mine):
            return lambda key: 0
        k = mine[pick]
        start = sections[k][1]
        end = sections[k + 1][1] if k + 1 < len(sections) else len(lines) + 1
        # The entry's sub-tables ([model.tolerance]) run until the next section that is not one of them.
        last = k + 1
        while last < len(sections) and sections[last][0].startswith(wanted + "."):
            last += 1
        subs = sections[k + 1 : last]
        entry_end = sections[last][1] if last < len(sections) else len(lines) + 1

        def find(key: str) -> int:
            head, _, sub = key.partition(".")
            if sub:
                table = next((ln for name, ln in subs if name == f"{wanted}.{head}" and ln < entry_end), None)
                if table is not None:
                    stop = next((ln for _, ln in sections if ln > table), len(lines) + 1)
                    return search(sub, table + 1, stop) or table
            return search(head, start + 1, end) or start

        return find

    return finder


def combined(entry_line: Any, defaults_line: Any, entry: Mapping[str, Any]) -> Any:
    """``line_of(key)`` for one ``[[model]]``: the entry's line for a key it sets (and ``name``/``path``), else
    the line in ``[defaults]``."""
    def line_of(key: str) -> int:
        root = key.split(".", 1)[0]
        return entry_line(key) if root in entry or root in ("name", "path") else defaults_line(key)

    return line_of
