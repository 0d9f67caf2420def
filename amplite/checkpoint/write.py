"""Streaming writers: every weight is read from its shard, cast to its planned dtype and written, one
tensor at a time; the FP32 model is never materialised.

* :func:`write_safetensors_dir`: the checkpoint's own layout (same shard names and membership, a new
  index), so ``from_pretrained``-style loaders read the low-precision weights directly.
* :func:`write_pt2`: a ``torch.export`` archive whose weights are the converted tensors. The program is
  saved with one-element stand-ins for its weights, then the archive is rewritten entry by entry with
  the real bytes streamed in and the weight metadata fixed.

Both write to a temporary path and rename: nothing partial is left behind. The directory's other files
(``config.json``, the copied tokenizer and generation files) are made in :mod:`amplite.checkpoint.side_files`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.passes import move_to_device_pass
from torch.utils._pytree import tree_map_only

from amplite.checkpoint.side_files import Entry, copy_side_files, output_config
from amplite.checkpoint.source import INDEX, Checkpoint, TensorInfo
from amplite.converter import emit
from amplite.errors import EmitError
from amplite.paths import check_output

Progress = Callable[[int], None]  # called with bytes written


class Layout(Protocol):
    """What each source tensor becomes (``checkpoint.fp8.Fp8Plan``: an FP8 weight and its scales) and the
    ``quantization_config`` that says so; without one, each tensor is written once, cast to its planned dtype."""

    def entries(self, info: TensorInfo, dtype: torch.dtype) -> list[Entry]: ...
    def tensors(self, info: TensorInfo, t: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]: ...
    def quantization_config(self) -> dict[str, Any]: ...


_ST_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip
_TORCH_DTYPE_CODES = {torch.float32: 7, torch.float16: 6, torch.bfloat16: 13, torch.float64: 8, torch.int64: 5,
                      torch.int32: 4, torch.bool: 12, torch.uint8: 1, torch.int8: 2, torch.int16: 3}  # fmt: skip


def _raw(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes without copying them again."""
    t = t.contiguous().reshape(-1)  # a 0-dim tensor cannot be viewed as bytes directly
    return memoryview(t.view(torch.uint8).numpy() if t.numel() else b"")


def cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` when it is floating point (integer tensors keep theirs)."""
    return t if t.dtype == dtype or not t.dtype.is_floating_point else t.to(dtype)


def write_shard(
    dest: Path, infos: list[TensorInfo], dtypes: dict[str, torch.dtype], progress: Progress,
    layout: Layout | None = None,
) -> tuple[int, list[Entry]]:
    """Write one safetensors file: header first (shapes and dtypes are known), then each tensor's bytes.

    ``infos`` all come from one source shard, which is opened (memory-mapped) once.

    Returns:
        The data bytes written and the tensors (name, dtype, shape), in file order.
    """
    from safetensors import safe_open

    def entries(info: TensorInfo) -> list[Entry]:
        dt = dtypes.get(info.name, info.dtype) if info.dtype.is_floating_point else info.dtype
        return layout.entries(info, dt) if layout is not None else [(info.name, dt, info.shape)]

    header: dict[str, Any] = {"__metadata__": {"format": "pt", "converted_by": "amplite"}}
    offset = 0
    written = [e for info in infos for e in entries(info)]
    for name, dt, shape in written:
        size = dt.itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with dest.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        if not infos:
            return offset, written
        with safe_open(str(infos[0].shard), framework="pt") as src:
            for info in infos:
                dt = entries(info)[0][1]
                t = src.get_tensor(info.name)
                outs = layout.tensors(info, t, dt) if layout is not None else [cast_tensor(t, dt)]
                for out in outs:
                    fh.write(_raw(out))
                progress(t.nbytes)
                del t, outs
    return offset, written


def write_safetensors_dir(
    ckpt: Checkpoint, out_dir: Path, dtypes: dict[str, torch.dtype], plan: dict[str, Any], progress: Progress,
    layout: Layout | None = None,
) -> Path:
    """The converted checkpoint in the source's layout, plus ``amplite-plan.json``, into ``out_dir``
    (``layout``: the tensors each source tensor becomes, and the ``quantization_config`` they need).

    Raises:
        EmitError: ``out_dir`` exists and is not empty, or cannot be written.
    """
    check_output(out_dir, "-o", directory=True)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise EmitError(f"{out_dir} exists and is not empty", "choose a new output directory or remove it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        by_shard: dict[Path, list[TensorInfo]] = {}
        for info in ckpt.tensors.values():
            by_shard.setdefault(info.shard, []).append(info)
        total = 0
        weight_map: dict[str, str] = {}
        tensors: list[Entry] = []
        for shard in ckpt.shards:
            size, written = write_shard(staging / shard.name, by_shard.get(shard, []), dtypes, progress, layout)
            total += size
            tensors += written
            weight_map.update({name: shard.name for name, _, _ in written})
        if (ckpt.path / INDEX).exists():
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX).write_text(json.dumps(index, indent=2))
        plan = {**plan, "not_copied": copy_side_files(ckpt.path, staging)}
        config = output_config(ckpt, tensors, layout.quantization_config() if layout is not None else None)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "amplite-plan.json").write_text(json.dumps(plan, indent=1, default=str))
        mask = _umask()
        for f in staging.iterdir():
            os.chmod(f, 0o666 & ~mask)
        os.chmod(staging, 0o777 & ~mask)  # mkdtemp makes it private; the output follows the umask
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise EmitError(f"cannot write {out_dir}: {exc.strerror or exc}", "check the path and free space") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def write_pt2(
    program: ExportedProgram,
    dest: Path,
    tensors: dict[str, Callable[[], torch.Tensor]],
    progress: Progress,
    aliases: dict[str, str] | None = None,
    conversion: dict[str, Any] | None = None,
) -> Path:
    """Save ``program`` (meta weights) as a ``.pt2`` whose weights are streamed from ``tensors``.

    Args:
        program: The converted program; its state dict and constants may be on the meta device.
        dest: Output path.
        tensors: State-dict/constant name -> a function returning that tensor's converted values.
        progress: Called with the bytes of each tensor written.
        aliases: Weight -> an earlier weight with the same values (tied weights): its entry points to that
            weight's file, so the bytes are stored once.
        conversion: The record of how it was made (``extra/amplite.json``: ``emit.conversion_record``).
    """
    check_output(dest, "-o")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    skeleton_dir = tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent)
    skeleton = os.path.join(skeleton_dir, dest.name)  # the archive's folder is named after it
    try:
        with cpu_stand_ins(program) as metas:
            extra = {emit.CONVERSION_ENTRY: json.dumps(conversion, allow_nan=False)} if conversion is not None else None
            torch.export.save(program, skeleton, extra_files=extra)
        _stream_archive(Path(skeleton), Path(tmp), metas, tensors, progress, aliases or {})
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    except OSError as exc:
        raise EmitError(f"cannot write {dest}: {exc.strerror or exc}", "check the path and free space") from None
    finally:
        for p in (tmp, skeleton):
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(skeleton_dir, ignore_errors=True)
    return dest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def cpu_stand_ins(program: ExportedProgram) -> Iterator[dict[str, torch.Tensor]]:
    """Swap the program's (meta) weights for one-element CPU stand-ins and retarget its graph to the CPU.

    The program was traced on meta: its factory ops (arange, masks) and metadata name that device. The
    move leaves the graph on the CPU for good; the weights (yielded, by name) are put back afterwards.
    """
    saved = dict(program._state_dict), dict(program._constants), program._example_inputs
    metas: dict[str, torch.Tensor] = {}
    try:
        for store in (program._state_dict, program._constants):
            for name, t in list(store.items()):
                if isinstance(t, torch.Tensor):
                    metas[name] = t
                    stand = torch.zeros(1, dtype=t.dtype)
                    store[name] = torch.nn.Parameter(stand, t.requires_grad) if isinstance(t, nn.Parameter) else stand
        if program._example_inputs is not None:
            program._example_inputs = tree_map_only(
                torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), program._example_inputs
            )
        move_to_device_pass(program, {"meta": "cpu"})
        yield metas
    finally:
        program._state_dict.clear()
        program._state_dict.update(saved[0])
        program._constants.clear()
        program._constants.update(saved[1])
        program._example_inputs = saved[2]


def _stream_archive(
    skeleton: Path, out: Path, metas: dict[str, torch.Tensor], tensors: dict[str, Callable[[], torch.Tensor]],
    progress: Progress, aliases: dict[str, str],
) -> None:
    """Copy the skeleton archive, replacing each weight file by the real bytes and fixing its metadata."""
    with zipfile.ZipFile(skeleton) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as dst:
        configs = [n for n in src.namelist() if n.endswith(("weights_config.json", "constants_config.json"))]
        files: dict[str, str] = {}  # archive path of a weight file -> tensor name
        fixed: dict[str, bytes] = {}
        dropped: set[str] = set()
        for cfg_name in configs:
            cfg = json.loads(src.read(cfg_name))
            folder = cfg_name.rsplit("/", 1)[0]
            entries = cfg.get("config", {})
            for name, entry in entries.items():
                if name not in metas or entry.get("use_pickle"):
                    continue
                meta = metas[name]
                tm = entry["tensor_meta"]
                tm["sizes"] = [{"as_int": int(s)} for s in meta.shape]
                tm["strides"] = [{"as_int": s} for s in _contiguous_strides(tuple(meta.shape))]
                tm["storage_offset"] = {"as_int": 0}
                files[f"{folder}/{entry['path_name']}"] = name
            for name, entry in entries.items():  # a tied weight reads its twin's file
                twin = entries.get(aliases.get(name, ""))
                if twin is not None and not entry.get("use_pickle") and not twin.get("use_pickle"):
                    dropped.add(f"{folder}/{entry['path_name']}")
                    entry["path_name"] = twin["path_name"]
            fixed[cfg_name] = json.dumps(cfg).encode()
        for item in src.infolist():
            if item.filename in dropped:
                continue
            if item.filename in fixed:
                dst.writestr(item.filename, fixed[item.filename])
            elif item.filename in files:
                name = files[item.filename]
                t = tensors[name]().contiguous()
                with dst.open(zipfile.ZipInfo(item.filename), "w", force_zip64=True) as fh:
                    fh.write(_raw(t))
                progress(t.nbytes)
                del t
            else:
                dst.writestr(item, src.read(item.filename))


class Pt2Weights:
    """Read the weights of a ``.pt2`` :func:`write_pt2` wrote, one tensor at a time (verification reads back
    what was written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, tuple[str, dict[str, Any]]] = {}
        codes = {v: k for k, v in _TORCH_DTYPE_CODES.items()}
        self._codes = codes
        with zipfile.ZipFile(path) as zf:
            for cfg_name in zf.namelist():
                if cfg_name.endswith(("weights_config.json", "constants_config.json")):
                    folder = cfg_name.rsplit("/", 1)[0]
                    for name, entry in json.loads(zf.read(cfg_name)).get("config", {}).items():
                        self.entries[name] = (f"{folder}/{entry['path_name']}", entry["tensor_meta"])

    def tensor(self, name: str) -> torch.Tensor:
        """The weight ``name`` as written."""
        member, meta = self.entries[name]
        with zipfile.ZipFile(self.path) as zf:
            data = bytearray(zf.read(member))
        shape = [int(s["as_int"]) for s in meta["sizes"]]
        dtype = self._codes[meta["dtype"]]
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return flat[: math.prod(shape)].reshape(shape)


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return list(reversed(strides))
