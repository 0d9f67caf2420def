"""Golden references and baselines: what ``amplite check`` compares a converted model against.

Golden references: saved inputs and FP32 reference outputs to check converted models against.

A golden directory holds ``golden.json`` (metadata: schema version, the model file and its SHA-256, the
tree structure of inputs and outputs, each file's SHA-256) and, per batch ``i``, ``inputs_{i:03d}.safetensors``
and ``outputs_{i:03d}.safetensors`` (tensor leaves under their flat index). It is written to a temporary
directory and renamed into place, so a failed run leaves the old one intact; an existing one is only
replaced when asked (``--update-golden``).

Baselines: an accepted earlier report.json whose metrics the new ones may not be worse than
(:func:`compare_baseline`, in :mod:`amplite.verify.baseline`; its names are re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.errors import AmpliteError, EmitError
from amplite.paths import check_output, inside, not_a_file
from amplite.verify.baseline import check_baseline_matches, compare_baseline, load_baseline
from amplite.verify.compare import output_names

SCHEMA = "amplite.golden"
SCHEMA_VERSION = 1
META = "golden.json"

# The baseline functions live in ``baseline``; they stay importable from here.
__all__ = [
    "META",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Golden",
    "GoldenError",
    "check_baseline_matches",
    "check_outputs_match",
    "compare_baseline",
    "file_sha256",
    "load_baseline",
    "load_golden",
    "save_golden",
]
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


class GoldenError(AmpliteError):
    """A golden directory is missing, corrupt, or was made from another model."""


@dataclass
class Golden:
    """A loaded golden directory: ``batches`` of ``(label, inputs)`` and their reference ``outputs``."""

    path: Path
    meta: dict[str, Any]
    batches: list[tuple[str, Inputs]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file (of the empty string for a missing one)."""
    h = hashlib.sha256()
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _save_tree(tree: Any, path: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    leaves, spec = pytree.tree_flatten(tree)
    tensors, constants = {}, {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors[str(i)] = leaf.detach().cpu().contiguous().clone()
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            constants[str(i)] = leaf
        else:
            raise GoldenError(f"cannot store a {type(leaf).__name__} in a golden file", "use tensor inputs")
    save_file(tensors, str(path))
    return {"file": path.name, "sha256": file_sha256(path), "spec": pytree.treespec_dumps(spec), "constants": constants}


def save_golden(
    directory: str | Path,
    reference: Any,
    batches: list[tuple[str, Inputs]],
    *,
    source: dict[str, Any] | None = None,
    update: bool = False,
    option: str = "-o",
) -> Path:
    """Run ``reference`` on each batch and save inputs and outputs under ``directory``.

    Args:
        directory: The golden directory to create (or replace, with ``update``).
        reference: The FP32 model (callable on ``*args, **kwargs``).
        batches: ``(label, (args, kwargs))`` pairs.
        source: Facts about the model (``path``, ``format``); its file's SHA-256 is added.
        update: Replace an existing golden directory.
        option: The option that named ``directory``, for messages (``check`` names it ``--golden``).

    Raises:
        GoldenError: The directory exists and ``update`` is false, or holds files that are not a golden set.
        EmitError: The parent directory cannot be written.
    """
    d = Path(directory)
    check_output(d, "the golden directory", directory=True)
    if d.exists():
        if not update:
            raise GoldenError(f"golden directory {str(d)!r} already exists", "pass --update-golden to regenerate it")
        if not d.is_dir() or (any(d.iterdir()) and not (d / META).is_file()):
            raise GoldenError(f"{str(d)!r} is not a golden directory", f"choose an empty or new directory for {option}")
    parent = d.parent if str(d.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise EmitError(f"cannot create golden directory {str(d)!r}: parent is missing or not writable",
                        f"fix {option}")  # fmt: skip
    src = dict(source or {})
    if src.get("path"):
        src["sha256"] = file_sha256(src["path"])
    try:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{d.name}.", suffix=".tmp"))
    except OSError as exc:  # access() says yes to root on /proc or a read-only mount
        raise EmitError(f"cannot create golden directory {str(d)!r}: {exc.strerror or type(exc).__name__}",
                        "choose a writable -o directory") from None  # fmt: skip
    try:
        entries = []
        for i, (label, inputs) in enumerate(batches):
            with torch.no_grad():
                out = reference(*inputs[0], **inputs[1])
            entries.append(
                {
                    "label": label,
                    "inputs": _save_tree(inputs, tmp / f"inputs_{i:03d}.safetensors"),
                    "outputs": _save_tree(out, tmp / f"outputs_{i:03d}.safetensors"),
                    "output_names": output_names(out),
                    "output_shapes": [
                        list(t.shape) if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(out)
                    ],
                }
            )
        meta = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "source": src,
            "batches": entries,
        }
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _swap_into_place(tmp, d)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # disk full, permissions: the user's environment, not a bug
            raise EmitError(f"writing golden directory {str(d)!r} failed: {type(exc).__name__}: {exc}",
                            "check disk space and permissions") from exc  # fmt: skip
        raise
    return d


def _swap_into_place(tmp: Path, d: Path) -> None:
    """Rename ``tmp`` to ``d``, moving an existing ``d`` aside first and deleting it only afterwards."""
    old = None
    if d.exists():
        old = d.with_name(f".{d.name}.old.{os.getpid()}")
        os.replace(d, old)
    try:
        os.replace(tmp, d)
    except BaseException:
        if old is not None:
            os.replace(old, d)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_REGEN = "regenerate the golden directory (--update-golden)"


def _load_tree(d: Path, entry: dict[str, Any]) -> Any:
    from safetensors.torch import load_file

    name = entry["file"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors", name):
        raise GoldenError(f"golden entry names the file {str(name)[:80]!r}: only plain file names inside the golden "
                          "directory are read (no '..', absolute paths or folders)", _REGEN)  # fmt: skip
    path = d / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != d.resolve()):
        raise GoldenError(f"golden file {str(path)!r} is a symlink; golden files are read only from inside the "
                          "golden directory", _REGEN)  # fmt: skip
    problem = not_a_file(path)
    if problem is not None:
        raise GoldenError(f"golden file {str(path)!r} {'is missing' if problem == 'does not exist' else problem}",
                          _REGEN)  # fmt: skip
    if file_sha256(path) != entry["sha256"]:
        raise GoldenError(
            f"golden file {str(path)!r} does not match its checksum in {META} (corrupt or edited)",
            "restore it from version control or regenerate with --update-golden",
        )
    tensors = load_file(str(path))
    spec = pytree.treespec_loads(entry["spec"])
    leaves = [tensors[str(i)] if str(i) in tensors else entry["constants"][str(i)] for i in range(spec.num_leaves)]
    return pytree.tree_unflatten(leaves, spec)


def load_golden(directory: str | Path) -> Golden:
    """Read a golden directory written by :func:`save_golden`.

    Raises:
        GoldenError: Missing directory or metadata, unknown schema, missing or corrupt files.
    """
    d = Path(directory)
    fix = "create it with `amplite golden MODEL -o DIR` (or `check --update-golden`)"
    if not d.is_dir():
        raise GoldenError(f"golden directory {str(d)!r} does not exist", fix)
    try:
        meta_path = inside(d, META, "the metadata", "the golden directory", _REGEN)
        problem = not_a_file(meta_path)
        if problem is not None and problem != "does not exist":
            raise GoldenError(f"{str(meta_path)!r} {problem}", _REGEN)
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("schema") != SCHEMA:
            raise ValueError(f"schema is {meta.get('schema')!r}, not {SCHEMA!r}")
        if int(meta.get("schema_version", 0)) > SCHEMA_VERSION:
            raise ValueError(f"schema version {meta['schema_version']} is newer than this amplite's")
        golden = Golden(d, meta)
        for entry in meta["batches"]:
            golden.batches.append((f"golden {entry['label']}", _load_tree(d, entry["inputs"])))
            golden.outputs.append(_load_tree(d, entry["outputs"]))
    except AmpliteError:
        raise
    except FileNotFoundError:
        raise GoldenError(f"{str(d)!r} has no {META}: it is not a golden directory", fix) from None
    except Exception as exc:
        raise GoldenError(
            f"golden directory {str(d)!r} is corrupt: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            "regenerate it with --update-golden",
        ) from exc
    if not golden.batches:
        raise GoldenError(f"golden directory {str(d)!r} holds no batches", "regenerate it with --update-golden")
    return golden


def check_outputs_match(golden: Golden, index: int, outputs: Any) -> None:
    """Fail when a model's outputs are not shaped like the golden ones (another model's golden set).

    Raises:
        GoldenError: Naming the first output that differs.
    """
    want = golden.outputs[index]
    names_w, names_h = output_names(want), output_names(outputs)
    leaves_w, leaves_h = pytree.tree_leaves(want), pytree.tree_leaves(outputs)
    fix = "this golden directory was made from another model: pass the right --golden or regenerate it"
    if names_w != names_h:
        raise GoldenError(f"golden outputs are {names_w}, the model returns {names_h}", fix)
    for name, w, h in zip(names_w, leaves_w, leaves_h, strict=True):
        if isinstance(w, torch.Tensor) and isinstance(h, torch.Tensor) and w.shape != h.shape:
            raise GoldenError(f"golden {name} has shape {list(w.shape)}, the model returns {list(h.shape)}", fix)
