"""A transformers checkpoint directory as a source: config, shard index, tensor metadata, the meta model.

Nothing here reads a weight's values except :func:`weight_stats` (one tensor at a time) and the
non-persistent buffers a model computes in ``__init__`` (rotary frequencies and the like), which are
small and built on the CPU.
"""

from __future__ import annotations

import inspect
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amplite import paths
from amplite.errors import InputSpecError, LoadError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB


@dataclass
class TensorInfo:
    """Where one tensor lives and what it is."""

    name: str
    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Checkpoint:
    """A checkpoint directory: its config and every tensor's shard, dtype and shape.

    Attributes:
        path: The directory.
        config: ``config.json`` as a dict.
        tensors: Tensor name -> :class:`TensorInfo`, in shard order.
        shards: Shard files in index order.
    """

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    shards: list[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors on disk."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def largest_shard_bytes(self) -> int:
        """Size of the largest shard file."""
        return max((s.stat().st_size for s in self.shards), default=0)


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a transformers ``config.json`` or safetensors weights."""
    p = Path(path)
    return p.is_dir() and ((p / "config.json").exists() or (p / INDEX).exists() or (p / SINGLE).exists())


def read_header(shard: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data offsets).

    Checked as safetensors' own reader checks it when the file is opened later (so that its
    ``SafetensorError`` never reaches the user): each tensor's range fits its dtype and shape and the ranges
    tile the data exactly (no overlap, no gap).

    Raises:
        LoadError: Not a regular file (a FIFO would block), unreadable, or a header that does not fit the data.
    """
    problem = paths.not_a_file(shard)
    if problem is not None:
        raise LoadError(f"shard {str(shard)!r} {problem}", "re-download or regenerate that shard")
    try:
        with shard.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("the file is shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > min(_MAX_HEADER, shard.stat().st_size - 8):
                raise ValueError(f"the header claims {size} bytes")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, RecursionError) as exc:
        raise LoadError(f"{shard} is not a readable safetensors shard ({exc})",
                        "re-download or regenerate that shard") from None  # fmt: skip
    data_len = shard.stat().st_size - 8 - size
    bad = not isinstance(header, dict)
    extra = header.get("__metadata__", {}) if not bad else {}
    if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
        raise LoadError(f"{shard}: the safetensors __metadata__ is not a table of strings (corrupt shard)",
                        "re-download or regenerate that shard")  # fmt: skip
    for name, meta in (header.items() if not bad else ()):
        if name == "__metadata__":
            continue
        try:
            start, end = meta["data_offsets"]
            shape = meta["shape"]
            # whole numbers only, as safetensors' reader parses them: 8.0 or true compare equal to 8 or 1 here
            ok = all(type(v) is int for v in (start, end, *shape)) and all(d >= 0 for d in shape)
            count = math.prod(shape) if ok else -1
            ok = ok and meta["dtype"] in _ST_DTYPES and 0 <= start <= end <= data_len
            ok = ok and count >= 0 and end - start == count * _ST_DTYPES[meta["dtype"]].itemsize
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise LoadError(f"{shard}: tensor {name!r} has a bad dtype, shape or data range (truncated or corrupt "
                            "shard)", "re-download or regenerate that shard")  # fmt: skip
    if bad:
        raise LoadError(f"{shard}: the safetensors header is not an object", "re-download or regenerate that shard")
    ranges = sorted((m["data_offsets"][0], m["data_offsets"][1], n) for n, m in header.items() if n != "__metadata__")
    at = 0
    for start, end, name in ranges:
        if start != at:
            raise LoadError(f"{shard}: tensor {name!r} {'overlaps another' if start < at else 'leaves a gap before it'}"
                            " in the data (corrupt shard)", "re-download or regenerate that shard")  # fmt: skip
        at = end
    if at != data_len:
        raise LoadError(f"{shard}: the tensors do not cover the data ({at} of {data_len} bytes; corrupt shard)",
                        "re-download or regenerate that shard")  # fmt: skip
    return header


def inside(root: Path, name: object, what: str) -> Path:
    """``root / name`` when it is a plain file name inside ``root`` (no ``..``, absolute path or symlink):
    :func:`amplite.paths.inside`, the rule for every directory amplite reads files from.

    Raises:
        LoadError: ``name`` leaves the directory, or is a symlink.
    """
    return paths.inside(root, name, what, "the checkpoint directory",
                        "copy the file into the directory instead of linking it")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint directory's config and shard headers (no weight values).

    Every file read is a plain file inside the directory; a tensor held by two shards, or by a shard the
    index does not name for it, is refused (from_pretrained would pick one silently).

    Raises:
        LoadError: No config, a missing or corrupt shard, an index naming a missing file, a path that leaves
            the directory, a duplicated tensor.
    """
    root = Path(path)
    cfg_path = inside(root, "config.json", "config")
    if not cfg_path.is_file():
        raise LoadError(f"{root} has no config.json", "point at a transformers checkpoint directory (config.json + "
                        "*.safetensors)")  # fmt: skip
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise LoadError(f"{cfg_path} is not valid JSON ({exc})", "fix or regenerate config.json") from None
    if not isinstance(config, dict):
        raise LoadError(f"{cfg_path} is not a JSON object", "fix or regenerate config.json")
    weight_map: dict[str, str] = {}
    if inside(root, INDEX, "index").exists():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of tensor name -> shard file name")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise LoadError(f"{root / INDEX} is not a valid index ({exc})", "regenerate the index") from None
        shards = list(dict.fromkeys(weight_map.values()))
    elif inside(root, SINGLE, "shard").exists():
        shards = [SINGLE]
    else:
        raise LoadError(f"{root} has no {SINGLE} and no {INDEX}", "save the checkpoint with safe_serialization")
    ckpt = Checkpoint(root, config)
    for name in shards:
        shard = inside(root, name, "the index names shard")
        if not shard.is_file():
            raise LoadError(f"the index names {name}, which is not in {root}", "copy the missing shard")
        ckpt.shards.append(shard)
        for tname, meta in read_header(shard).items():
            if tname == "__metadata__":
                continue
            other = ckpt.tensors.get(tname)
            if other is not None:
                raise LoadError(f"tensor {tname!r} is in {name} and in {other.shard.name}",
                                "the shards disagree: regenerate the checkpoint (one copy of each tensor)")  # fmt: skip
            if weight_map.get(tname, name) != name:  # from_pretrained reads it from the shard the index names
                raise LoadError(f"the index names {weight_map[tname]} for tensor {tname!r}, but {name} holds it",
                                "the index and the shards do not belong together: regenerate the index")  # fmt: skip
            start, end = meta["data_offsets"]
            shape = meta.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise LoadError(f"{shard}: tensor {tname!r} has a bad shape", "regenerate that shard")
            ckpt.tensors[tname] = TensorInfo(tname, shard, _ST_DTYPES[meta["dtype"]], tuple(shape), end - start)
    missing = [t for t in weight_map if t not in ckpt.tensors]
    if missing:
        raise LoadError(f"the index lists {len(missing)} tensors no shard holds (e.g. {missing[0]})",
                        "the shards and the index do not belong together: regenerate the index")  # fmt: skip
    return ckpt


PREFIX = "lm."


class LogitsOnly(nn.Module):
    """``forward(input_ids, ...) -> logits`` of a transformers model (no cache, plain tensor output).

    The converted program then loads and runs anywhere, without transformers' output classes.
    Its weight names are the model's with :data:`PREFIX` in front. ``attention_mask``,
    ``decoder_input_ids`` (encoder-decoder models) and ``token_type_ids`` are passed when given.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self._use_cache = "use_cache" in inspect.signature(lm.forward).parameters

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        named = {"attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids,
                 "token_type_ids": token_type_ids}  # fmt: skip
        extra: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
        if self._use_cache:
            extra["use_cache"] = False
        return self.lm(input_ids=input_ids, **extra, return_dict=False)[0]


def example_inputs_for(config: dict[str, Any], batch: int = 1, seq: int = 8) -> tuple[tuple, dict[str, Any]]:
    """``input_ids`` of shape ``(batch, seq)`` on meta (zeros: valid ids for any vocabulary); encoder-decoder
    models also get ``decoder_input_ids`` of the same shape."""
    if "vocab_size" not in config and "d_model" not in config and "hidden_size" not in config:
        raise InputSpecError("the config has no vocab_size: amplite cannot derive example inputs",
                             "pass --input NAME:SHAPE:DTYPE for this model")  # fmt: skip
    ids = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
    kwargs = {"decoder_input_ids": ids.clone()} if config.get("is_encoder_decoder") else {}
    return (ids,), kwargs


def _open_shard(shard: Path) -> Any:
    """``safe_open`` on a shard; its ``SafetensorError`` (a shard changed after its header was read) is one
    line naming the shard."""
    from safetensors import safe_open

    try:
        return safe_open(str(shard), framework="pt")
    except Exception as exc:
        raise LoadError(f"{shard} is not a readable safetensors shard ({type(exc).__name__}: {str(exc)[:200]})",
                        "re-download or regenerate that shard") from None  # fmt: skip


def load_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor's values from its shard (only that tensor is read)."""
    with _open_shard(info.shard) as fh:
        return fh.get_tensor(info.name)


def iter_shard(shard: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a shard, one at a time (memory-mapped read)."""
    with _open_shard(shard) as fh:
        for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, fh.get_tensor(name)
