"""A transformers checkpoint directory as a source: config, shard index, tensor metadata, the meta model.

Nothing here reads a weight's values except :func:`weight_stats` (one tensor at a time) and the
non-persistent buffers a model computes in ``__init__`` (rotary frequencies and the like), which are
small and built on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amplite.errors import InputSpecError, LoadError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
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
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data offsets)."""
    try:
        with shard.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("the file is shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > min(_MAX_HEADER, shard.stat().st_size - 8):
                raise ValueError(f"the header claims {size} bytes")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as exc:
        raise LoadError(f"{shard} is not a readable safetensors shard ({exc})",
                        "re-download or regenerate that shard") from None  # fmt: skip
    data_len = shard.stat().st_size - 8 - size
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta.get("data_offsets", (0, -1))
        if meta.get("dtype") not in _ST_DTYPES or not 0 <= start <= end <= data_len:
            raise LoadError(f"{shard}: tensor {name!r} has a bad dtype or data range (truncated or corrupt shard)",
                            "re-download or regenerate that shard")  # fmt: skip
    return header


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint directory's config and shard headers (no weight values).

    Raises:
        LoadError: No config, a missing or corrupt shard, an index naming a missing file.
    """
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise LoadError(f"{root} has no config.json", "point at a transformers checkpoint directory (config.json + "
                        "*.safetensors)")  # fmt: skip
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{cfg_path} is not valid JSON ({exc})", "fix or regenerate config.json") from None
    if (root / INDEX).exists():
        try:
            weight_map: dict[str, str] = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"{root / INDEX} is not a valid index ({exc})", "regenerate the index") from None
        shards = list(dict.fromkeys(weight_map.values()))
    elif (root / SINGLE).exists():
        weight_map, shards = {}, [SINGLE]
    else:
        raise LoadError(f"{root} has no {SINGLE} and no {INDEX}", "save the checkpoint with safe_serialization")
    ckpt = Checkpoint(root, config)
    for name in shards:
        shard = root / name
        if not shard.is_file():
            raise LoadError(f"the index names {name}, which is not in {root}", "copy the missing shard")
        ckpt.shards.append(shard)
        for tname, meta in read_header(shard).items():
            if tname == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            ckpt.tensors[tname] = TensorInfo(tname, shard, _ST_DTYPES[meta["dtype"]], tuple(meta["shape"]), end - start)
    missing = [t for t, s in weight_map.items() if t not in ckpt.tensors]
    if missing:
        raise LoadError(f"the index lists {len(missing)} tensors no shard holds (e.g. {missing[0]})",
                        "the shards and the index do not belong together: regenerate the index")  # fmt: skip
    return ckpt


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device (buffers stay real): no weight memory is allocated."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None:
            kind = type(self._parameters[name])
            self._parameters[name] = kind(self._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_meta_model(ckpt: Checkpoint) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model from ``config.json`` with meta parameters, and its real buffers (moved off the model).

    Returns:
        The model wrapped in :class:`LogitsOnly` (every parameter and buffer on meta, eval mode) and the
        buffers' real values by (wrapped) name.

    Raises:
        LoadError: transformers is missing or cannot build the config.
    """
    try:
        import transformers
    except ImportError:
        raise LoadError("converting a checkpoint directory needs transformers",
                        "pip install transformers") from None  # fmt: skip
    try:
        config = transformers.AutoConfig.for_model(**ckpt.config)
        arch = (ckpt.config.get("architectures") or [None])[0]
        cls = getattr(transformers, arch) if arch and hasattr(transformers, arch) else None
        with _params_on_meta():
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise LoadError(f"transformers cannot build {ckpt.path / 'config.json'}: {type(exc).__name__}: {exc}",
                        "check model_type and architectures in config.json") from None  # fmt: skip
    model = LogitsOnly(model).eval()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    for module in model.modules():
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type != "meta":
                module._buffers[bname] = b.to("meta")
    return model, buffers


PREFIX = "lm."


class LogitsOnly(nn.Module):
    """``forward(input_ids) -> logits`` of a transformers model (no cache, plain tensor output).

    The converted program then loads and runs anywhere, without transformers' output classes.
    Its weight names are the checkpoint's with :data:`PREFIX` in front.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def example_inputs_for(config: dict[str, Any], batch: int = 1, seq: int = 8) -> tuple[tuple, dict[str, Any]]:
    """``input_ids`` of shape ``(batch, seq)`` on meta (zeros: valid ids for any vocabulary)."""
    if "vocab_size" not in config:
        raise InputSpecError("the config has no vocab_size: amplite cannot derive example inputs",
                             "pass --input NAME:SHAPE:DTYPE for this model")  # fmt: skip
    ids = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
    return (ids,), {}


def load_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor's values from its shard (only that tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(info.shard), framework="pt") as fh:
        return fh.get_tensor(info.name)


def iter_shard(shard: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a shard, one at a time (memory-mapped read)."""
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, fh.get_tensor(name)
