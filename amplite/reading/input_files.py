"""Reading user input files (``--inputs``, every file of ``--data``/``--calib``) without trusting them.

Every input file goes through :func:`read_input_file`; it returns the raw object (tensor, tuple, list or
dict of tensors) and has checked, before anything large is allocated:

- ``.npz``: each ``.npy`` member's header is parsed here (``numpy.lib.format``), never by ``np.load``: the
  dtype must be a plain bool/int/float/complex dtype (no object, void, structured or zero-size dtypes), the
  element count at most :data:`MAX_ELEMENTS`, and ``count × itemsize`` must equal the member's data bytes.
  The array is then built with ``np.frombuffer`` over the bytes read, so a header cannot claim more;
- ``torch.save``: loaded with ``weights_only=True`` (views only: storages hold the file's bytes), then every
  tensor must fit in its storage and hold no more elements than its storage (no ``expand``-ed or
  overlapping views that turn a few bytes into gigabytes), the nesting is bounded, and the total bytes are
  at most :data:`MAX_TOTAL_BYTES`;
- ``.safetensors``: safetensors' own reader (it checks offsets against dtype and shape), then the same bound.

Warnings raised while reading (pickle protocol, torch ``UserWarning``) are held back and re-issued only
when the file was read successfully, so a refusal is one line. Any failure is an :class:`InputSpecError`.
"""

from __future__ import annotations

import math
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amplite.errors import AmpliteError, InputSpecError

#: Largest element count of one array or tensor in an input file (2**33: 32 GiB of float32).
MAX_ELEMENTS = 2**33
#: Largest total bytes of the tensors of one input file, counted as materialised (numel × itemsize).
MAX_TOTAL_BYTES = 64 * 2**30
#: Deepest nesting of tuples/lists/dicts in a torch.save inputs file.
MAX_DEPTH = 32
_KINDS = "biufc"  # bool, signed, unsigned, float, complex: what torch.from_numpy takes
_FIX = "save inputs with torch.save (tensors, tuples, dicts), numpy.savez or safetensors"


def read_input_file(p: Path) -> Any:
    """The content of input file ``p`` after the checks in the module docstring.

    Raises:
        InputSpecError: A file that is unreadable, malformed, or claims more elements or bytes than it holds.
    """
    with p.open("rb") as f:
        head = f.read(8)
    is_zip = head.startswith(b"PK")
    npz = is_zip and (p.suffix == ".npz" or _is_npz(p))
    if is_zip:  # torch.save and .npz files are zips: no zip bombs or duplicate entries
        from amplite.reading.archive import check_zip

        check_zip(p, rooted=not npz, fix="re-save the inputs (torch.save, numpy.savez or safetensors)")
    if p.suffix == ".safetensors":
        reader: Callable[[Path], Any] = _read_safetensors
    elif npz or p.suffix == ".npz":
        reader = _read_npz
    else:
        reader = _read_torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = reader(p)
            _check_tree(p, data)
        except AmpliteError:
            raise
        except Exception as exc:  # whatever the parser raises, the file is at fault
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise InputSpecError(f"cannot read inputs file {str(p)!r}: {type(exc).__name__}: {first}", _FIX) from None
    for w in caught:  # the file was read: its warnings may matter now
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return data


def _refuse(p: Path, problem: str, fix: str = _FIX) -> InputSpecError:
    return InputSpecError(f"inputs file {str(p)!r}: {problem}", fix)


def _is_npz(p: Path) -> bool:
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
    except Exception:  # BadZipFile, NotImplementedError (a version or method field), ...: check_zip names it
        return False
    return bool(names) and all(n.endswith(".npy") for n in names)


def _read_safetensors(p: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(str(p))


def _read_torch(p: Path) -> Any:
    return torch.load(p, map_location="cpu", weights_only=True)


def _read_npz(p: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    total = 0
    with zipfile.ZipFile(p) as z:
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                raise _refuse(p, f"member {info.filename!r} is not a .npy array")
            name = info.filename[: -len(".npy")]
            with z.open(info) as f:
                dtype, shape, fortran, header_len = _npy_header(p, info.filename, f)
                count = math.prod(shape)
                nbytes = count * dtype.itemsize
                if count > MAX_ELEMENTS:
                    raise _refuse(p, f"array {name!r} claims {count:,} elements (at most {MAX_ELEMENTS:,})")
                if nbytes != info.file_size - header_len:
                    raise _refuse(p, f"array {name!r} claims {nbytes:,} bytes of data, its member holds "
                                     f"{info.file_size - header_len:,}")  # fmt: skip
                total += nbytes
                if total > MAX_TOTAL_BYTES:
                    raise _refuse(p, f"its arrays hold more than {MAX_TOTAL_BYTES:,} bytes")
                raw = f.read(nbytes)
            if len(raw) != nbytes:
                raise _refuse(p, f"array {name!r} is truncated")
            arr = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape, order="F" if fortran else "C")
            out[name] = torch.from_numpy(arr.copy())
    return out


def _npy_header(p: Path, member: str, f: Any) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Parse one .npy header with numpy's own header reader; refuse dtypes that are not plain numbers."""
    from numpy.lib import format as npformat

    stream = f
    try:
        major, _ = npformat.read_magic(stream)
        read = {1: npformat.read_array_header_1_0, 2: npformat.read_array_header_2_0}.get(major)
        if read is None:
            raise ValueError(f"unsupported .npy format version {major}")
        shape, fortran, dtype = read(stream)
        header_len = stream.tell()
    except Exception as exc:  # numpy: ValueError, SyntaxError, RecursionError...
        raise _refuse(p, f"member {member!r} has a malformed .npy header ({type(exc).__name__})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in _KINDS \
            or dtype.itemsize == 0:  # fmt: skip
        raise _refuse(p, f"member {member!r} has dtype {dtype.str!r}; only bool, integer, float and complex "
                         "arrays are inputs")  # fmt: skip
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise _refuse(p, f"member {member!r} has an invalid shape")
    return dtype, shape, fortran, header_len


def _check_tree(p: Path, data: Any) -> None:
    """Every tensor fits its storage and holds at most its storage's elements; bounded depth and bytes."""
    total = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _refuse(p, f"its containers nest deeper than {MAX_DEPTH} levels")
        if isinstance(obj, torch.Tensor):
            total += _tensor_bytes(p, obj)
            if total > MAX_TOTAL_BYTES:
                raise _refuse(p, f"its tensors hold more than {MAX_TOTAL_BYTES:,} bytes")
        elif isinstance(obj, (tuple, list)):
            stack.extend((v, depth + 1) for v in obj)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if depth == 0 and not isinstance(k, str):  # top-level keys are forward()'s parameter names
                    raise _refuse(p, f"a key is a {type(k).__name__} ({str(k)[:40]!r}), not an input name")
                stack.append((v, depth + 1))


def _tensor_bytes(p: Path, t: torch.Tensor) -> int:
    """The tensor's materialised bytes, refusing views that claim more than their storage holds."""
    if t.layout != torch.strided or t.is_quantized:
        raise _refuse(p, f"a tensor has layout {t.layout}; inputs are dense tensors")
    numel, item = t.numel(), t.element_size()
    if numel > MAX_ELEMENTS:
        raise _refuse(p, f"a tensor of shape {tuple(t.shape)} claims {numel:,} elements (at most {MAX_ELEMENTS:,})")
    if numel == 0:
        return 0
    storage = t.untyped_storage().nbytes()
    span = (t.storage_offset() + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * item
    if numel * item > storage or span > storage or any(st == 0 for s, st in zip(t.shape, t.stride(), strict=True)
                                                      if s > 1):  # fmt: skip
        raise _refuse(p, f"a tensor of shape {tuple(t.shape)} with strides {t.stride()} is a view over "
                         f"{storage:,} bytes that would expand to {numel * item:,} (an expanded or overlapping "
                         "view)", "save t.contiguous() (or t.clone()) instead of the view")  # fmt: skip
    return numel * item
