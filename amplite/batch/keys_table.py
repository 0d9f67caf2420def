"""The manifest's keys, as data, and the check of one value: what ``[defaults]`` and ``[[model]]`` may say.

``JOB_KEYS`` maps each key to the one-line description errors quote; :func:`check_value` normalises a
value or raises ``ValueError`` naming the problem (``SubKeyError`` for a bad key inside a sub-table). The
conversion keys, their kinds and descriptions come from ``amplite.ConvertOptions``' field metadata: a
new conversion option with a manifest kind is a manifest key at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from amplite.errors import AmpliteError, ConfigError
from amplite.levels import resolve_level
from amplite.options import ConvertOptions, Kind
from amplite.policy import Level
from amplite.verify.compare import Tolerance

#: The keys of a job that are not conversion options (how to find the model and its inputs, what to write,
#: how to run the worker), with their descriptions and kinds.
_JOB_ONLY: dict[str, tuple[Kind, str]] = {
    "name": ("string", "a name of letters, digits, '.', '_' or '-'"),
    "path": ("string", "the model file (.pt2, state dict, pickled module or TorchScript)"),
    "inputs": ("list", "a list of input specs NAME:SHAPE:DTYPE[lo,hi)"),
    "inputs_file": ("string", "an inputs file (torch.save, .npz, .safetensors)"),
    "seed": ("integer", "an integer seed for the random inputs"),
    "formats": ("list", 'a list of output formats, e.g. ["pt2"]'),
    "calib": ("string", "a directory of calibration batches"),
    "calib_loader": ("string", "module:function yielding calibration batches"),
    "timeout": ("number", "seconds (a positive number)"),
    "max_memory_gb": ("number", "GiB of address space for the worker (a positive number)"),
}
#: Every manifest key and its kind: the job's own, then each conversion option a manifest can set (a field
#: of ``amplite.ConvertOptions`` whose metadata has a manifest kind; ``calibration`` is ``calib`` /
#: ``calib_loader`` above).
_KINDS: dict[str, str] = {
    **{k: kind for k, (kind, _) in _JOB_ONLY.items()},
    **{k: o.kind for k, o in ConvertOptions.described().items() if o.kind != "none"},
}
#: Each key's description of a valid value, as errors quote it.
JOB_KEYS: dict[str, str] = {
    **{k: text for k, (_, text) in _JOB_ONLY.items()},
    **{k: o.manifest for k, o in ConvertOptions.described().items() if o.kind != "none"},
}
MODEL_ONLY = ("name", "path")
#: A manifest tolerance table's keys: the thresholds of :class:`amplite.verify.compare.Tolerance` (criteria
#: text excepted).
TOLERANCE_KEYS = tuple(f.name for f in fields(Tolerance) if f.name != "criteria")


def conversion_keys() -> tuple[str, ...]:
    """The manifest keys that are ``amplite.ConvertOptions`` fields of the same name (tolerance excepted:
    a manifest table, turned into a ``Tolerance`` by the worker)."""
    return tuple(k for k, o in ConvertOptions.described().items() if o.kind not in ("none", "tolerance"))


class SubKeyError(ValueError):
    """A bad key or value inside a table value (``tolerance``): ``subkey`` locates it in the manifest."""

    def __init__(self, problem: str, subkey: str) -> None:
        super().__init__(problem)
        self.subkey = subkey


def check_value(key: str, value: Any) -> Any:
    """Normalise one value; raise ValueError(problem) when it has the wrong type or is invalid."""
    kind = _KINDS[key]
    if kind == "list":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return tuple(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if kind == "string":
        if not isinstance(value, str) or not value:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return value
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if kind == "level":
        try:
            return resolve_level(str(value)).value  # the one parser of level names
        except ConfigError:
            raise ValueError(f"unknown level {value!r}") from None
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return value
    if kind == "number":
        # TOML has nan and inf: a NaN passes no comparison, so `<= 0` alone would let it through
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        return float(value)
    if kind == "tolerance":
        if not isinstance(value, Mapping):
            raise ValueError(f"expected {JOB_KEYS[key]}, got {value!r}")
        bad = [k for k in value if k not in TOLERANCE_KEYS]
        if bad:
            raise SubKeyError(f"unknown tolerance key {bad[0]!r} (known: {', '.join(TOLERANCE_KEYS)})", bad[0])
        for k, v in value.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise SubKeyError(f"tolerance values must be numbers, got {k} = {v!r}", k)
            if math.isnan(v):  # every comparison with it is False: no output could pass or fail it
                raise SubKeyError(f"tolerance {k} is nan", k)
        return {k: float(v) for k, v in value.items()}
    raise KeyError(key)


def manifest_values(options: ConvertOptions) -> dict[str, Any]:
    """The options given (not at their defaults) as manifest values: ``calibration`` as ``calib`` (a directory)
    or ``calib_loader`` (``module:function``), a tolerance as its table, a level as its name, lists as lists."""
    from amplite.verify.data import is_loader_spec

    out: dict[str, Any] = {}
    for name, value in options.given().items():
        if name == "calibration" and isinstance(value, (str, Path)):
            out["calib_loader" if is_loader_spec(value) else "calib"] = str(value)
        elif name == "tolerance" and isinstance(value, Tolerance) and not value.criteria:
            out[name] = {k: getattr(value, k) for k in TOLERANCE_KEYS}
        elif isinstance(value, Level):
            out[name] = value.value
        else:
            out[name] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def conversion_problem(values: Mapping[str, Any]) -> tuple[str, AmpliteError] | None:
    """The first value of a job the converter would refuse before any work that the options' own checks
    (:meth:`ConvertOptions.spec`, run by the manifest reader) do not see, as ``(key, error)``: input specs
    and the GPU profile, so that a bad value stops the batch when the manifest is read instead of failing
    its model."""
    from amplite.converter.inputs import check_generated_bytes, parse_input_spec, spec_bytes
    from amplite.estimate.profiles import get_profile

    try:
        for spec in values.get("inputs", ()):
            size = spec_bytes(spec)  # 0: the spec does not parse (or has a zero dimension), so parsing raises
            parse_input_spec(spec, torch.Generator()) if size == 0 else check_generated_bytes(size, f"--input {spec!r}")
    except AmpliteError as exc:  # InputSpecError
        return "inputs", exc
    if "gpu_profile" in values:
        try:
            get_profile(values["gpu_profile"])
        except ConfigError as exc:
            return "gpu_profile", exc
    return None
