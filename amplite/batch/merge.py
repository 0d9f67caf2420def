"""``amplite batch merge``: read shard summaries (checked for the shape and types merging and rendering read)
and combine them into one ``summary.json``/``summary.md``.

A summary comes from a file the user passes, so everything in it is checked before use: each row's fields
have the types amplite writes (:data:`_ROW_FIELDS`), and a split ``i/n`` is never expanded into ``range(n)``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amplite.batch.summary import SCHEMA, STATUSES, MergeError, write_summary
from amplite.paths import not_a_file


def read_summary(path: Path) -> dict[str, Any]:
    """Load a ``summary.json`` (or the one in a directory).

    Raises:
        MergeError: Missing or not an amplite batch summary.
    """
    p = path / "summary.json" if path.is_dir() else path
    problem = not_a_file(p)  # a FIFO would block the read
    if problem is not None and problem != "does not exist":
        raise MergeError(f"batch summary {str(p)!r} {problem}", "pass the output directories of finished "
                         "`amplite batch` runs")  # fmt: skip
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise MergeError(
            f"cannot read batch summary {str(p)!r}: {type(exc).__name__}: {str(exc)[:200]}",
            "pass the output directories of finished `amplite batch` runs",
        ) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or _summary_shape(doc):
        why = f" ({_summary_shape(doc)})" if isinstance(doc, dict) and doc.get("schema") == SCHEMA else ""
        raise MergeError(
            f"{str(p)!r} is not an amplite batch summary{why}", "pass `amplite batch` output directories"
        )
    return doc


def _summary_shape(doc: dict[str, Any]) -> str:
    """What is wrong with the fields :func:`merge_summaries` reads ('' when nothing)."""
    models, shard = doc.get("models"), doc.get("shard")
    if not isinstance(models, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str)
                                                and isinstance(r.get("output_dir", ""), str) for r in models):
        return "'models' is not a list of rows with a string 'name'"
    for row in models:
        problem = _row_problem(row)
        if problem:
            return f"model {row['name'][:80]!r}: {problem}"
    if shard is not None:
        m = re.fullmatch(r"(\d{1,9})/(\d{1,9})", shard) if isinstance(shard, str) else None
        if m is None or not int(m.group(1)) < int(m.group(2)):
            return "'shard' is not 'i/n' with 0 <= i < n"
    if not _number(doc.get("seconds")) or isinstance(doc.get("seconds"), bool):
        return "'seconds' is not a number"
    return ""


def _number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


#: The type each field of a summary row must have when present (what render_markdown and merging read).
_ROW_FIELDS: dict[str, Any] = {
    "status": lambda v: isinstance(v, str) and v in STATUSES,
    "error": lambda v: v is None or isinstance(v, str),
    "resumed": lambda v: v is None or isinstance(v, bool),
    "params": _number, "low_precision_share": _number, "casts": _number, "size_ratio": _number,
    "seconds": _number, "worst_sqnr_db": lambda v: _number(v) or isinstance(v, str),
}  # fmt: skip


def _path_safe(v: str) -> bool:
    """Whether ``v`` can be part of a path (no NUL byte, no character the file system encoding refuses)."""
    try:
        os.fsencode(v)
    except UnicodeError:
        return False
    return "\x00" not in v


def _row_problem(row: dict[str, Any]) -> str:
    if "status" not in row:
        return "no 'status'"
    for key in ("name", "output_dir"):  # the model's directory is found by them
        if key in row and not _path_safe(row[key]):
            return f"{key!r} cannot be part of a path (a NUL byte or an unencodable character)"
    bad = next((k for k, ok in _ROW_FIELDS.items() if k in row and not ok(row[k])), None)
    if bad == "status":
        return f"'status' is not one of {', '.join(STATUSES)}"
    return f"{bad!r} is a {type(row[bad]).__name__}" if bad else ""


def merge_summaries(
    shard_dirs: Sequence[str | Path], out_dir: str | Path
) -> tuple[dict[str, Any], Path, Path]:
    """Combine shard summaries into ``out_dir/summary.json`` and ``summary.md``.

    Rows keep pointing at their model directories (``output_dir`` is made relative to ``out_dir``); nothing
    is copied. Shards must come from one ``--shard i/n`` split, with every index present once.

    Raises:
        MergeError: No shards, mixed shard counts, a shard given twice or missing, or a model in two shards.
    """
    if not shard_dirs:
        raise MergeError("no shard directories given", "pass the output directory of every shard")
    out = Path(out_dir)
    docs = [(Path(d), read_summary(Path(d))) for d in shard_dirs]
    shards = [doc.get("shard") for _, doc in docs]
    if any(s is not None for s in shards):
        if any(s is None for s in shards) or len({s.split("/")[1] for s in shards}) != 1:
            raise MergeError(
                f"the summaries come from different splits ({', '.join(map(str, shards))})",
                "merge the shards of one `--shard i/n` run with the same n",
            )
        n = int(shards[0].split("/")[1])
        seen = Counter(int(s.split("/")[0]) for s in shards)
        twice = sorted(i for i, c in seen.items() if c > 1)
        # the first few missing indices, without building range(n): n comes from the file (up to 10^9 - 1)
        missing = list(itertools.islice((i for i in range(n) if i not in seen), 5))
        if twice:
            raise MergeError(f"shard {twice[0]}/{n} is given twice", "pass each shard's directory once")
        if missing:
            more = n - len(seen) - len(missing)
            raise MergeError(
                f"shard(s) {', '.join(f'{i}/{n}' for i in missing)}{f' and {more} more' if more > 0 else ''} missing",
                "run the missing shards (or pass their directories) before merging",
            )
    rows: list[dict[str, Any]] = []
    owner: dict[str, Path] = {}
    for d, doc in docs:
        for row in doc["models"]:
            if row["name"] in owner:
                raise MergeError(
                    f"model {row['name']!r} is in both {str(owner[row['name']])!r} and {str(d)!r}",
                    "merge outputs of one split only",
                )
            owner[row["name"]] = d
            target = (d / row.get("output_dir", row["name"])).resolve()
            rows.append({**row, "output_dir": os.path.relpath(target, out.resolve())})
    meta = {
        "source": docs[0][1].get("source"),
        "out_dir": str(out),
        "shard": None,
        "merged_from": [str(d) for d, _ in docs],
        "seconds": max((doc.get("seconds") or 0.0) for _, doc in docs),
        "interrupted": any(doc.get("interrupted") for _, doc in docs),
    }
    js, md = write_summary(out, rows, meta)
    return {**meta, "models": rows}, js, md
