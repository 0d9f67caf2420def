"""One typed, frozen description of a conversion: :class:`ConvertSpec`.

``amplite.convert``'s keyword arguments are validated once, here, into a spec (one-line ``ConfigError``
for each bad value); from then on the pipeline, the verification, the budget search and the report read
typed fields: the low dtype as a ``torch.dtype``, the level as a :class:`~amplite.policy.Level`, the rules
as :class:`~amplite.policy.Override` values carrying their source. The report's ``config`` section is
:meth:`ConvertSpec.to_config`. Layer: above the converter (it parses dynamic dims, resolves fusion and
builds :class:`~amplite.passes.range_guard.RangeRules`), below verify (the budget search takes a spec).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from amplite.converter.tracing import parse_dynamic_dims
from amplite.errors import ConfigError
from amplite.levels import FP8, LEVEL_ENV, Level, precision_name, resolve_level, split_precision
from amplite.ops.fusion_default import resolve as resolve_fuse
from amplite.passes.range_guard import RangeRules
from amplite.policy import Override, PrecisionPolicy, make_overrides


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


@dataclass(frozen=True)
class ConvertSpec:
    """What a conversion does, resolved and checked.

    Attributes:
        precision: The low dtype (``torch.float16`` or ``torch.bfloat16``).
        level: The optimisation level.
        level_source: Where the level came from: ``argument``, ``AMPLITE_LEVEL`` or ``default``.
        overrides: The precision rules, each with its source (the user's, or amplite's own pins).
        low_precision_io: Graph inputs and outputs take the low dtype too.
        dynamic_batch: Dim 0 of every input is dynamic.
        dynamic_dims: More dynamic dims by input name, ``(("ids", (1,)),)``.
        fuse: Fuse contraction chains into ``amplite::contract``.
        fuse_reason: Why fusion is on or off (the report's ``fuse_contractions_reason``).
        ranges: The range rules' settings.
        fold_batchnorm: Fold inference BatchNorm into the preceding convolution.
        gpu_profile: GPU of the report's time estimate.
        fp8: ``--precision fp8``'s settings (``precision`` is then bf16, the dtype of everything not in
            FP8), or None.
    """

    precision: torch.dtype = torch.float16
    level: Level = Level.O1
    level_source: str = "default"
    overrides: tuple[Override, ...] = ()
    low_precision_io: bool = False
    dynamic_batch: bool = False
    dynamic_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fuse: bool = False
    fuse_reason: str = "off (requested)"
    ranges: RangeSpec = field(default_factory=RangeSpec)
    fold_batchnorm: bool = True
    gpu_profile: str = "H100"
    fp8: Fp8Spec | None = None

    @classmethod
    def build(
        cls,
        *,
        precision: str | torch.dtype = "fp16",
        level: str | Level | None = None,
        keep_fp32: Iterable[str | Override] = (),
        force_low: Iterable[str | Override] = (),
        low_precision_io: bool = False,
        dynamic_batch: bool = False,
        dynamic_dims: Sequence[str] | Mapping[str, Sequence[int]] = (),
        fuse_contractions: bool | str = "auto",
        range_rules: bool | None = None,
        data_max: float = RangeRules.data_max,
        max_reduction_depth: int | None = RangeRules.max_reduction_depth,
        range_percentile: float | None = None,
        fold_batchnorm: bool = True,
        gpu_profile: str = "H100",
        calibrated: bool = False,
    ) -> ConvertSpec:
        """The spec of ``amplite.convert``'s keyword arguments (same names and defaults; ``calibrated``:
        calibration data was given, which makes FP8's activation scales static).

        Raises:
            ConfigError: For the first value that is not valid, with the fix.
        """
        source = "argument" if level is not None else (LEVEL_ENV if os.environ.get(LEVEL_ENV) else "default")
        low, fp8 = split_precision(precision)
        resolved = resolve_level(level, precision)  # FP8's default level: O2
        if fp8 and resolved is Level.O0:
            raise ConfigError("--precision fp8 at O0 converts nothing", "use --level O2 (fp8's default) or O1/O3")
        fuse, fuse_reason = resolve_fuse(fuse_contractions, low)  # measured per (GPU, backend, dtype)
        dims = parse_dynamic_dims(dynamic_dims)
        return cls(
            precision=low,
            level=resolved,
            level_source=source,
            overrides=make_overrides(keep_fp32, force_low),
            low_precision_io=bool(low_precision_io),
            dynamic_batch=bool(dynamic_batch),
            dynamic_dims=tuple((name, tuple(d)) for name, d in dims.items()),
            fuse=fuse,
            fuse_reason=fuse_reason,
            ranges=RangeSpec(range_rules, data_max, max_reduction_depth, range_percentile),
            fold_batchnorm=bool(fold_batchnorm),
            gpu_profile=gpu_profile,
            fp8=Fp8Spec.of(calibrated) if fp8 else None,
        )

    @property
    def precision_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp8``."""
        return FP8 if self.fp8 is not None else precision_name(self.precision)

    def policy(self) -> PrecisionPolicy:
        """The precision policy of this spec."""
        fp8 = self.fp8.activations if self.fp8 is not None else ""
        return PrecisionPolicy(self.precision, self.level, self.overrides, self.low_precision_io, fp8=fp8)

    def range_rules(self) -> RangeRules | None:
        """The range rules to apply, or None when they are off (explicitly, or by level)."""
        on = self.ranges.enabled if self.ranges.enabled is not None else self.level in (Level.O1, Level.O2)
        if not on:
            return None
        r = self.ranges
        return RangeRules(data_max=r.data_max, max_reduction_depth=r.max_reduction_depth, percentile=r.percentile)

    def dims(self) -> dict[str, list[int]]:
        """The dynamic dims as ``{input name: [dims]}``."""
        return {name: list(d) for name, d in self.dynamic_dims}

    def with_overrides(self, extra: Iterable[Override]) -> ConvertSpec:
        """This spec with more rules (the budget search's pins), after the ones it has."""
        return replace(self, overrides=(*self.overrides, *extra))

    def patterns(self, action: str) -> list[str]:
        """The patterns of the ``keep_fp32`` or ``force_low`` rules, as written."""
        return [r.pattern for r in self.overrides if r.action == action]

    def to_config(self) -> dict[str, Any]:
        """The report's ``config`` section (JSON; amplite/schemas/report.schema.json)."""
        rules = self.range_rules()
        return {
            "precision": self.precision_name,
            "level": self.level.value,
            "level_source": self.level_source,
            "keep_fp32": self.patterns("keep_fp32"),
            "force_low": self.patterns("force_low"),
            "low_precision_io": self.low_precision_io,
            "dynamic_batch": self.dynamic_batch,
            "dynamic_dims": self.dims(),
            "fuse_contractions": self.fuse,
            "fuse_contractions_reason": self.fuse_reason,
            "range_rules": vars(rules) if rules else None,
            "fold_batchnorm": self.fold_batchnorm,
            **({"fp8": {**self.fp8.to_config(), "level": f"{self.level.value} ({self.level_source}; "
                        "fp8's default is O2)"}} if self.fp8 is not None else {}),
        }
