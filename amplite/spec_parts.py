"""The parts of a :class:`~amplite.spec.ConvertSpec` that stand alone: the range rules' settings
(:class:`RangeSpec`), FP8's (:class:`Fp8Spec`), the ``--dynamic-dim`` parser, and the checks its JSON reader
(``ConvertSpec.from_json``) builds on. Layer: just below :mod:`amplite.spec`, above the passes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from amplite.errors import ConfigError
from amplite.passes.range_guard import RangeRules

_DIM_SPEC = re.compile(r"^(?P<name>[A-Za-z_][\w.]*):(?P<dims>-?\d+(?:,-?\d+)*)$")


def parse_dynamic_dims(specs: Sequence[str] | Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """``["ids:1", "x:0,2"]`` (``--dynamic-dim NAME:DIM[,DIM]``) or a mapping -> ``{name: [dims]}``.

    Raises:
        ConfigError: A spec that does not parse.
    """
    if not specs:
        return {}
    if isinstance(specs, Mapping):
        return {str(k): [int(d) for d in ([v] if isinstance(v, int) else v)] for k, v in specs.items()}
    out: dict[str, list[int]] = {}
    for spec in specs:
        m = _DIM_SPEC.match(spec.strip())
        if not m:
            raise ConfigError(f"cannot parse --dynamic-dim {spec!r}", "write NAME:DIM[,DIM], e.g. ids:1 or x:0,2")
        out.setdefault(m["name"], []).extend(int(d) for d in m["dims"].split(","))
    return out


@dataclass(frozen=True)
class RangeSpec:
    """The range rules' settings (``range_guard``).

    Attributes:
        enabled: On/off; None: on at O1/O2, off at O0/O3 (the speed baseline).
        data_max: Largest |activation| kept in fp16.
        max_reduction_depth: Longest reduction kept in low precision (None: no limit).
        percentile: Judge the activation rule on this percentile of |x| (None: the maximum).
    """

    enabled: bool | None = None
    data_max: float = RangeRules.data_max
    max_reduction_depth: int | None = RangeRules.max_reduction_depth
    percentile: float | None = None

    def __post_init__(self) -> None:
        if self.percentile is not None and not 50.0 <= self.percentile < 100.0:
            raise ConfigError(
                f"range percentile {self.percentile:g} is out of range", "give a percentile in [50, 100), e.g. 99.99"
            )
        if not self.data_max > 0:
            raise ConfigError(f"data_max {self.data_max!r} is not positive", "give the largest |activation|, e.g. 512")


@dataclass(frozen=True)
class Fp8Spec:
    """``--precision fp8``: matrix products with a stored weight in ``float8_e4m3fn`` (docs/fp8.md).

    Attributes:
        activations: ``static`` (one FP32 scale per tensor, chosen by measured error on the calibration data:
            ``amplite.converter.fp8_scales``) or ``dynamic``
            (one scale per token, from its own amax, computed at run time).
        reason: Why that scheme.
        weights: Weight scale granularity: ``per-output-channel``.
    """

    activations: Literal["static", "dynamic"]
    reason: str
    weights: str = "per-output-channel"

    @classmethod
    def of(cls, calibrated: bool) -> Fp8Spec:
        """Static scales when calibration data is given, else dynamic per token."""
        if calibrated:
            return cls("static", "calibration data given (calibration= / --calib / --calib-loader): "
                       "per-tensor scales chosen by measured e4m3 error on the calibrated activations")  # fmt: skip
        return cls("dynamic", "no calibration data: per-token scales from each row's amax at run time")

    def to_config(self) -> dict[str, str]:
        """The report's ``config.fp8``."""
        return {"format": "float8_e4m3fn", "activations": self.activations, "activation_reason": self.reason,
                "weights": self.weights,
                "scale": "FP32; weights amax/448; activations the largest amax·2^(k/8)/448 (k = 15 … -24) within "
                         "1 % of the least e4m3 error on the calibration data" if self.activations == "static"
                         else "FP32; amax/448"}  # fmt: skip


def short(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a record read from a file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def as_is(value: Any) -> Any:
    """The identity: a field written as it is."""
    return value


def typed(kind: type | tuple[type, ...]) -> Any:
    """A JSON decoder that accepts only ``kind`` (``TypeError`` otherwise; a bool is not an int here)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)

    def check(value: Any) -> Any:
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise TypeError(value)
        return value

    return check


def as_json(value: RangeSpec | Fp8Spec | None) -> dict[str, Any] | None:
    """A :class:`RangeSpec` or :class:`Fp8Spec` as a JSON object (None stays None)."""
    return None if value is None else {f.name: getattr(value, f.name) for f in fields(value)}


def range_spec(v: Any) -> RangeSpec:
    """The :class:`RangeSpec` :func:`as_json` wrote (``TypeError``/``ValueError`` for anything else)."""
    if set(typed(dict)(v)) != {f.name for f in fields(RangeSpec)}:
        raise ValueError(sorted(v))
    number, depth, pct = typed((int, float)), v["max_reduction_depth"], v["percentile"]
    return RangeSpec(typed((bool, type(None)))(v["enabled"]), float(number(v["data_max"])),
                     None if depth is None else typed(int)(depth),
                     None if pct is None else float(number(pct)))  # fmt: skip


def fp8_spec(v: Any) -> Fp8Spec | None:
    """The :class:`Fp8Spec` (or None) :func:`as_json` wrote."""
    if v is None:
        return None
    if set(typed(dict)(v)) != {f.name for f in fields(Fp8Spec)} or v["activations"] not in ("static", "dynamic"):
        raise ValueError(v)
    return Fp8Spec(v["activations"], typed(str)(v["reason"]), typed(str)(v["weights"]))
