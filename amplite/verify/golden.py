"""Golden references and baselines: what ``amplite check`` compares a converted model against.

Golden references: saved inputs and FP32 reference outputs to check converted models against.

A golden directory holds ``golden.json`` (metadata: schema version, the model file and its SHA-256, the
tree structure of inputs and outputs, each file's SHA-256) and, per batch ``i``, ``inputs_{i:03d}.safetensors``
and ``outputs_{i:03d}.safetensors`` (tensor leaves under their flat index). It is written to a temporary
directory and renamed into place, so a failed run leaves the old one intact; an existing one is only
replaced when asked (``--update-golden``).

Baselines: an accepted earlier report.json whose metrics the new ones may not be worse than
(:func:`compare_baseline`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.errors import AmpliteError, ConfigError, EmitError
from amplite.paths import check_output, inside, not_a_file
from amplite.verify.compare import output_names
from amplite.verify.numbers import decode_float

SCHEMA = "amplite.golden"
SCHEMA_VERSION = 1
META = "golden.json"
Inputs = tuple[tuple[Any, ...], dict[str, Any]]
_CAP_DB = 150.0  # SQNR above this is "exact" for baseline comparisons


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


def load_baseline(baseline: str | Path | dict[str, Any] | None) -> dict[str, Any] | None:
    """An accepted earlier report (path or dict) for ``compare_baseline``.

    Raises:
        ConfigError: Missing file, invalid JSON, or not an amplite report with verification.
    """
    fix = "pass a report.json written by `amplite check` (or `convert`) with verification"
    if baseline is None:
        return None
    if isinstance(baseline, dict):
        problem = _baseline_shape(baseline)
        if problem:
            raise ConfigError(f"the baseline report is not an amplite report: {problem}", fix)
        return baseline
    problem = not_a_file(baseline)
    if problem is not None:
        raise ConfigError(f"--baseline {str(baseline)!r} {problem}", fix)
    try:
        data = json.loads(Path(baseline).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--baseline {str(baseline)!r} does not exist", fix) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--baseline {str(baseline)!r} is not valid JSON ({exc})", fix) from None
    if not isinstance(data, dict) or data.get("schema") != "amplite.report" or "verification" not in data:
        raise ConfigError(f"--baseline {str(baseline)!r} is not an amplite report with verification", fix)
    problem = _baseline_shape(data)
    if problem:
        raise ConfigError(f"--baseline {str(baseline)!r} is not an amplite report: {problem}", fix)
    return data


def _baseline_shape(data: dict[str, Any]) -> str | None:
    """What is wrong with the parts of a baseline report :func:`compare_baseline` reads, else None."""
    source, verification = data.get("source", {}), data.get("verification", {})
    if not isinstance(source, dict) or not isinstance(source.get("graph_fingerprint", ""), (str, type(None))):
        return "'source' is not an object with a string 'graph_fingerprint'"
    if not isinstance(verification, dict) or not isinstance(verification.get("outputs", []), list):
        return "'verification' is not an object with an 'outputs' list"
    for i, o in enumerate(verification.get("outputs", [])):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return f"verification output #{i} is not an object with a string 'name'"
    return None


def check_baseline_matches(report: dict[str, Any], baseline: dict[str, Any], where: str = "--baseline") -> None:
    """Refuse a baseline report of another model: other output names or another graph fingerprint.

    Raises:
        ConfigError: Naming what differs.
    """
    fix = "pass a report.json of this model (or drop --baseline and accept a new one)"
    mine = report.get("source", {}).get("graph_fingerprint")
    theirs = baseline.get("source", {}).get("graph_fingerprint")
    if mine and theirs and mine != theirs:
        raise ConfigError(f"{where} is a report of another model (graph fingerprint {theirs}, this model {mine})", fix)
    names = [o["name"] for o in report.get("verification", {}).get("outputs", [])]
    old = [o["name"] for o in baseline.get("verification", {}).get("outputs", [])]
    if names and old and sorted(names) != sorted(old):
        raise ConfigError(f"{where} is a report of another model: its outputs are {', '.join(old)}, "
                          f"this model's {', '.join(names)}", fix)  # fmt: skip


_num = decode_float  # report numbers are read in one way (amplite.verify.numbers)


def compare_baseline(
    current: list[dict[str, Any]], baseline: dict[str, Any], margin_db: float = 1.0
) -> list[dict[str, Any]]:
    """Metrics worse than the baseline's beyond the margin, one dict per regression.

    SQNR may drop ``margin_db`` (values above 150 dB count as 150); error magnitudes (max/mean/p99
    abs) may grow by the matching amplitude ratio, 1 - cosine and KL by the power ratio; top-1/top-5
    agreement may drop by 0.002; new NaN/Inf may not increase, and a pass may not become a failure.
    """
    amp, power = 10 ** (margin_db / 20), 10 ** (margin_db / 10)
    base = {o["name"]: o for o in baseline.get("verification", {}).get("outputs", [])}
    found = []
    for cur in current:
        old = base.get(cur["name"])
        if old is None:
            continue

        def worse(
            metric: str, bad: Callable[[float, float], tuple[bool, float]], cur: dict = cur, old: dict = old
        ) -> None:
            c, b = _num(cur.get(metric)), _num(old.get(metric))
            if c is None or b is None:
                return
            regressed, limit = bad(c, b)
            if regressed or (math.isnan(c) and not math.isnan(b)):
                found.append(
                    {
                        "output": cur["name"],
                        "metric": metric,
                        "baseline": old.get(metric),
                        "current": cur.get(metric),
                        "limit": round(limit, 6),
                    }
                )

        worse("sqnr_db", lambda c, b: (min(c, _CAP_DB) < min(b, _CAP_DB) - margin_db, min(b, _CAP_DB) - margin_db))
        worse("cosine", lambda c, b: (1 - c > (1 - b) * power + 1e-12, 1 - (1 - b) * power - 1e-12))
        for metric in ("max_abs", "mean_abs", "p99_abs"):
            worse(metric, lambda c, b: (c > b * amp + 1e-12, b * amp + 1e-12))
        worse("kl_div", lambda c, b: (c > b * power + 1e-12, b * power + 1e-12))
        for metric in ("top1", "top5"):
            worse(metric, lambda c, b: (c < b - 0.002, b - 0.002))
        worse("new_nonfinite", lambda c, b: (c > b, b))
        if old.get("passed") and not cur.get("passed"):
            found.append({"output": cur["name"], "metric": "passed", "baseline": True, "current": False, "limit": True})
    return found
