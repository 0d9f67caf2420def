"""The files of a converted checkpoint directory besides its weights.

* :func:`output_config`: the output's ``config.json``, whose ``dtype`` is what most weight bytes are stored
  in and which records the mixed-dtype storage (and an FP8 checkpoint's ``quantization_config``).
* :func:`copy_side_files`: the source's tokenizer and generation files, copied only when they are plain files
  and not weights in another format (a pickle never reaches a converted output).

:func:`amplite.checkpoint.write.write_safetensors_dir` writes them next to the shards.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from amplite.checkpoint.source import INDEX, Checkpoint

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # a written tensor: name, dtype, shape


#: Weight files in other formats (pickles among them): never copied into a converted output.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".npz",
                    ".npy", ".gguf", ".onnx", ".pt2", ".joblib")  # fmt: skip


def copy_side_files(src: Path, dest: Path) -> list[str]:
    """Copy tokenizer and generation files: plain files inside ``src`` only (no symlinks, no subfolders), no
    weight files (a pickled ``pytorch_model.bin`` or an FP32 copy does not belong in a converted output).

    Returns:
        The names left out, with the reason.
    """
    skipped = []
    for extra in sorted(src.iterdir()):
        if extra.name in ("config.json", INDEX) or extra.name.startswith("."):
            continue
        if extra.is_symlink() or not extra.is_file():
            skipped.append(f"{extra.name} (a symlink or not a plain file)")
        elif extra.name.lower().endswith(_WEIGHT_SUFFIXES) or ".safetensors" in extra.name:
            if extra.suffix != ".safetensors":
                skipped.append(f"{extra.name} (weights in another format)")
        elif extra.name.lower().removesuffix(".index.json").endswith(_WEIGHT_SUFFIXES):
            skipped.append(f"{extra.name} (the index of weights that are not copied)")
        else:
            shutil.copyfile(extra, dest / extra.name)
    return skipped


def output_config(
    ckpt: Checkpoint, tensors: list[Entry], quantization: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``config.json`` for the output: ``dtype`` is what most weight bytes are stored in (an FP8 checkpoint's
    compute dtype, bf16, when ``quantization`` is given), and the mixed-dtype storage is recorded (``amplite``)
    where loaders and readers see it."""
    by_dtype: dict[str, int] = {}
    for _name, dt, shape in tensors:
        if dt.is_floating_point:
            key = str(dt).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + dt.itemsize * math.prod(shape)
    cfg = dict(ckpt.config)
    if by_dtype:
        cfg["dtype"] = "bfloat16" if quantization is not None else max(by_dtype, key=by_dtype.__getitem__)
        cfg.pop("torch_dtype", None)
    if quantization is not None:
        cfg["quantization_config"] = quantization
    cfg["amplite"] = {"storage_bytes_by_dtype": by_dtype, "plan": "amplite-plan.json"}
    return cfg
