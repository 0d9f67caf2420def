"""The manifest's keys, as data, and the check of one value: what ``[defaults]`` and ``[[model]]`` may say.

``JOB_KEYS`` maps each key to the one-line description errors quote; :func:`check_value` normalises a
value or raises ``ValueError`` naming the problem (``SubKeyError`` for a bad key inside a sub-table).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

JOB_KEYS: dict[str, str] = {
    "name": "a name of letters, digits, '.', '_' or '-'",
    "path": "the model file (.pt2, state dict, pickled module or TorchScript)",
    "inputs": "a list of input specs NAME:SHAPE:DTYPE[lo,hi)",
    "inputs_file": "an inputs file (torch.save, .npz, .safetensors)",
    "seed": "an integer seed for the random inputs",
    "precision": "fp16 or bf16",
    "level": "O0, O1, O2 or O3",
    "keep_fp32": "a list of patterns",
    "force_low": "a list of patterns",
    "tolerance": "a table with min_sqnr_db, min_cosine, max_mismatch",
    "formats": 'a list of output formats, e.g. ["pt2"]',
    "model_factory": "module:callable",
    "trust_pickle": "true or false",
    "dynamic_batch": "true or false",
    "low_precision_io": "true or false",
    "fuse_contractions": "true or false",
    "dynamic_dims": 'a list of NAME:DIM[,DIM] specs, e.g. ["ids:1"]',
    "range_rules": "true or false (default: on at O1/O2)",
    "data_max": "the largest |activation| kept in fp16 (a positive number)",
    "max_reduction_depth": "the longest reduction kept in low precision (a positive integer)",
    "fold_batchnorm": "true or false",
    "calib": "a directory of calibration batches",
    "calib_loader": "module:function yielding calibration batches",
    "import_modules": 'a list of modules to import first (pytree types, custom ops), e.g. ["mypkg.ops"]',
    "range_percentile": "a percentile of |x| for the activation range rule (e.g. 99.99)",
    "gpu_profile": "the GPU of the report's time estimate (H100, H200, A100, L4, RTX4090)",
    "verify": "true or false",
    "timeout": "seconds (a positive number)",
    "max_memory_gb": "GiB of address space for the worker (a positive number)",
}
MODEL_ONLY = ("name", "path")
_LISTS = ("inputs", "keep_fp32", "force_low", "formats", "dynamic_dims", "import_modules")
_BOOLS = ("trust_pickle", "dynamic_batch", "low_precision_io", "fuse_contractions", "verify", "range_rules",
          "fold_batchnorm")  # fmt: skip
_STRINGS = ("path", "inputs_file", "precision", "model_factory", "calib", "calib_loader", "gpu_profile")
#: Job keys passed to ``amplite.convert`` unchanged (the conversion options; ``calib``/``calib_loader``
#: become its ``calibration``).
CONVERT_KEYS = ("precision", "level", "keep_fp32", "force_low", "low_precision_io", "dynamic_batch", "dynamic_dims",
                "fuse_contractions", "trust_pickle", "model_factory", "verify", "range_rules", "data_max",
                "max_reduction_depth", "fold_batchnorm", "gpu_profile", "import_modules",
                "range_percentile")  # fmt: skip
_TOLERANCE_KEYS = ("min_sqnr_db", "min_cosine", "max_mismatch")

class SubKeyError(ValueError):
    """A bad key or value inside a table value (``tolerance``): ``subkey`` locates it in the manifest."""

    def __init__(self, problem: str, subkey: str) -> None:
        super().__init__(problem)
        self.subkey = subkey


def check_value(key: str, value: Any) -> Any:
    """Normalise one value; raise ValueError(problem) when it has the wrong type or is invalid."""
    if key in _LISTS:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return tuple(value)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if key in _STRINGS or key == "name":
        if not isinstance(value, str) or not value:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return value
    if key == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if key == "level":
        text = str(value).strip().upper()
        text = "O" + text if text in ("0", "1", "2", "3") else text
        if text not in ("O0", "O1", "O2", "O3"):
            raise ValueError(f"unknown level {value!r}")
        return text
    if key == "max_reduction_depth":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return value
    if key in ("timeout", "max_memory_gb", "data_max", "range_percentile"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return float(value)
    if key == "tolerance":
        if not isinstance(value, Mapping):
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        bad = [k for k in value if k not in _TOLERANCE_KEYS]
        if bad:
            raise SubKeyError(f"unknown tolerance key {bad[0]!r} (known: {', '.join(_TOLERANCE_KEYS)})", bad[0])
        for k, v in value.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise SubKeyError(f"tolerance values must be numbers, got {k} = {v!r}", k)
        return {k: float(v) for k, v in value.items()}
    raise KeyError(key)
