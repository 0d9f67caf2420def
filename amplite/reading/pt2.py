"""Load a .pt2 without torch's unsafe paths: the archive is inspected first, then built from what was checked.

amplite does not call ``torch.export.load``. It reads the entries :func:`~amplite.reading.archive.
inspect_archive` checked through the same reader, unpickles only with ``torch.load(weights_only=True)``
(anything else needs ``trust_pickle``), never loads AOTInductor binaries, and hands torch's program
deserializer ready tensors, so torch's own fallbacks to ``weights_only=False`` are never reached.

Modules named in the archive (pytree types of inputs/outputs, custom-op libraries) are imported only when the
user names them (``--import MODULE``) or they belong to :data:`~amplite.reading.imports.SAFE_AUTO_IMPORT`,
installed outside the working directory (:mod:`amplite.reading.imports`): importing a module runs its code, so
a name taken from an untrusted file must not pick it.

Nothing of the file is evaluated: size expressions are parsed by :mod:`amplite.reading.sym_expr` and handed
to torch as sympy objects; the file's ``guards_code`` (Python torch would ``exec``) is dropped, inputs are
checked against the program's range constraints instead; every operator is checked against
:mod:`amplite.reading.op_allowlist` by name before deserializing and, with the writes it makes, after.
"""

from __future__ import annotations

import io
import math
import operator
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.describe import summarize_exception
from amplite.errors import LoadError
from amplite.reading.archive import (
    CONSTANTS,
    TRUST_FIX,
    WEIGHTS,
    Archive,
    Pickled,
    check_zip_bytes,
    inspect_archive,
)
from amplite.reading.imports import SAFE_AUTO_IMPORT, import_user_modules, register_pytree_types
from amplite.reading.op_allowlist import check_program_ops, refusal
from amplite.reading.pt2_checks import (
    build_expressions,
    check_call_graph,
    check_example_inputs,
    check_expansion,
    check_payload_metadata,
    check_symbols,
)

# The module imports live in ``imports``; these names stay importable from here.
__all__ = ["SAFE_AUTO_IMPORT", "import_user_modules", "load_program", "resolve_target"]


def load_program(path: Path, *, trust_pickle: bool = False, import_modules: Sequence[str] = ()) -> ExportedProgram:
    """The ExportedProgram in ``path``, loaded without running code from the file (unless trusted).

    Raises:
        LoadError: A hostile or malformed archive, an entry that needs unpickling without ``trust_pickle``,
            an unregistered custom op or pytree type (naming the ``--import`` that fixes it).
    """
    custom = import_user_modules(import_modules)
    arch = inspect_archive(path)
    try:
        return _load(arch, trust_pickle, custom)
    except LoadError:
        raise
    except Exception as exc:  # torch's own checks on what passed ours (a device this machine lacks, ...)
        problem = f"cannot load .pt2 {str(path)!r}: {summarize_exception(exc)}"
        raise LoadError(problem, "re-export the model with this torch version on this kind of machine") from None
    finally:
        arch.close()


def _load(arch: Archive, trust_pickle: bool, custom: frozenset[str]) -> ExportedProgram:
    """Check targets and pytree types, refuse untrusted object kinds, load the entries, deserialize, check ops."""
    path = arch.path
    _check_targets(arch, custom)
    check_payload_metadata(path, arch.program_json, arch.weights, arch.constants)
    register_pytree_types(arch)
    for entry in arch.pickled:
        if entry.kind in ("custom_obj", "opaque_obj", "legacy") and not trust_pickle:
            raise LoadError(
                f"{str(path)!r}: {entry.record} holds {entry.what}; unpickling it runs code from the file",
                TRUST_FIX,
            )
    state_dict = _payloads(arch, "weights", trust_pickle)
    constants = _payloads(arch, "constants", trust_pickle)
    sample = _unpickle(arch, _entry(arch, "sample_inputs"), trust_pickle)
    if not (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], dict)
            and all(isinstance(k, str) for k in sample[1])):  # fmt: skip
        raise LoadError(f"{str(path)!r}: the example inputs are not (args, kwargs) with string keywords",
                        "re-save the model")  # fmt: skip
    check_example_inputs(path, sample)
    program = _deserialize(arch, state_dict, constants, sample)
    check_call_graph(path, program)
    check_symbols(path, program)
    why = check_program_ops(program, custom)
    if why is not None:
        raise LoadError(f"{str(path)!r}: {why}", "convert only programs written by torch.export.save")
    return program


def _entry(arch: Archive, kind: str) -> Pickled:
    return next(e for e in arch.pickled if e.kind == kind)


def _unpickle(arch: Archive, entry: Pickled, trust: bool) -> Any:
    data = arch.reader.read_bytes(entry.record)
    if data[:2] == b"PK":  # a torch.save zip inside the archive: the zip checks again (a nested zip bomb)
        check_zip_bytes(Path(f"{arch.path}:{entry.record}"), data)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        if not trust:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            cls = f" (class {found.group(1)})" if found else ""
            raise LoadError(
                f"{str(arch.path)!r}: {entry.record} holds {entry.what} with pickled Python objects{cls}; "
                "unpickling them runs code from the file",
                TRUST_FIX,
            ) from None
    except Exception as exc:
        problem = f"{str(arch.path)!r}: {entry.record} is not a torch.save file ({summarize_exception(exc)})"
        raise LoadError(problem, "re-save the model") from None
    try:
        return torch.load(io.BytesIO(data), weights_only=False)
    except Exception as exc:
        problem = f"{str(arch.path)!r}: unpickling {entry.record} failed: {summarize_exception(exc)}"
        raise LoadError(problem, "make its classes importable (run from the project directory)") from None


def _payloads(arch: Archive, section: str, trust: bool) -> dict[str, Any] | bytes:
    """Weights or constants as torch's loader builds them (aliases share storage), pickles loaded safely."""
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE, deserialize_device

    base = WEIGHTS if section == "weights" else CONSTANTS
    legacy = [e for e in arch.pickled if e.kind == "legacy" and e.section == section]
    if legacy:  # only reached with trust_pickle: torch's deserializer unpickles the bytes
        return arch.reader.read_bytes(legacy[0].record)
    config = arch.weights if section == "weights" else arch.constants
    pickled = {e.fqn: e for e in arch.pickled if e.section == section}
    storages: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for fqn, meta in config.items():
        entry = pickled.get(fqn)
        if entry is not None:
            if entry.kind == "tensor":
                value = _unpickle(arch, entry, trust)
                if not isinstance(value, torch.Tensor):
                    raise LoadError(f"{str(arch.path)!r}: {entry.what} is not a tensor", "re-save the model")
                out[fqn] = value
            elif entry.kind == "custom_obj":
                out[fqn] = torch._C._pickle_load_obj(arch.reader.read_bytes(entry.record))
            else:
                out[fqn] = pickle.loads(arch.reader.read_bytes(entry.record))
            continue
        tm = meta["tensor_meta"]
        dtype = _SERIALIZE_TO_TORCH_DTYPE[tm["dtype"]]
        name = meta["path_name"]
        if name not in storages:
            nbytes = arch.reader.archive_file.get_record_size(base + name)
            numel = nbytes // dtype.itemsize
            flat = torch.empty(0, dtype=dtype)
            if numel:
                raw = arch.reader.archive_file.get_storage_from_record(base + name, numel, dtype)
                flat.set_(raw.untyped_storage(), 0, (numel,), (1,))
            storages[name] = flat
        sizes = [s["as_int"] for s in tm["sizes"]]
        strides = [s["as_int"] for s in tm["strides"]]
        tensor = torch.as_strided(storages[name], sizes, strides, tm["storage_offset"]["as_int"])
        check_expansion(arch.path, f"the {section[:-1]} {fqn!r}", tensor)
        device = deserialize_device(_device(tm))
        if device != torch.device("cpu"):
            tensor = tensor.to(device)
        if meta.get("is_param"):
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(tm.get("requires_grad")))
        elif tm.get("requires_grad"):
            tensor.requires_grad_(True)
        out[fqn] = tensor
    return out


def _device(tm: dict[str, Any]) -> Any:
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    return _dict_to_dataclass(schema.Device, tm.get("device") or {"type": "cpu"})


def _deserialize(arch: Archive, state_dict: Any, constants: Any, sample: Any) -> ExportedProgram:
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, arch.program_json)
    except Exception as exc:
        raise LoadError(
            f"cannot load .pt2 {str(arch.path)!r}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
            "re-export the model with this torch version",
        ) from None
    build_expressions(arch.path, serialized)
    serialized.guards_code = []  # Python torch would exec: never loaded, never written back out
    try:
        return ExportedProgramDeserializer(None).deserialize(serialized, state_dict, constants, sample)
    except Exception as exc:
        raise LoadError(
            f"cannot load .pt2 {str(arch.path)!r}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
            "re-export the model with this torch version",
        ) from None


def resolve_target(target: str) -> Any:
    """The operator ``target`` names (as torch's deserializer resolves it), or None if it is not one.

    torch resolves ``torch.``/``math.``/``_operator.`` targets by attribute lookup, so ``torch.os.system``
    would become a graph node that runs a shell command: only operators are accepted.
    """
    from torch._export.serde.serialize import _SYM_OPS

    root, *names = target.split(".")
    obj: Any = {"_operator": operator, "math": math, "torch": torch}.get(root)
    for i, name in enumerate(names):
        # an ATen op may be named like a dunder (torch.ops.aten.__and__.Tensor); any other dunder is an attribute walk
        dunder_op = i == 2 and names[0] == "ops" and re.fullmatch(r"__[a-z]+__", name) is not None
        if obj is None or (name.startswith("__") and not dunder_op) or not name.isidentifier():
            return None
        if not hasattr(obj, name):
            return None
        obj = getattr(obj, name)
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return obj
    return obj if any(obj is op for op in _SYM_OPS) else None


def _check_targets(arch: Archive, custom: frozenset[str]) -> None:
    missing = []
    for target in sorted(arch.targets):
        if target.startswith("#"):
            continue  # extension ops: resolved by handlers code registered, never by name lookup
        op = resolve_target(target)
        if op is not None:
            why = refusal(op, custom)
            if why is not None:
                raise LoadError(f"{str(arch.path)!r}: a node calls {why}", "convert only programs torch.export wrote")
            continue
        if re.match(r"torch\.ops\.[A-Za-z_]\w*\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?\Z", target):
            ns, op = target.split(".")[2:4]
            missing.append(f"{ns}::{op}")
            continue
        problem = f"{str(arch.path)!r}: a node calls {target[:80]!r}, which is not an operator"
        raise LoadError(problem, "re-export the model with torch.export")
    if missing:
        raise LoadError(
            f"{str(arch.path)!r} uses custom ops that are not registered: {', '.join(missing[:5])}",
            "pass --import MODULE (import_modules=[...]) naming the package that registers them",
        )
