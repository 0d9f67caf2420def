"""One typed, frozen description of a conversion: :class:`ConvertSpec`.

``amplite.convert``'s keyword arguments are validated once, here, into a spec (one-line ``ConfigError``
for each bad value); from then on the pipeline, the verification, the budget search and the report read
typed fields: the low dtype as a ``torch.dtype``, the level as a :class:`~amplite.policy.Level`, the rules
as :class:`~amplite.policy.Override` values carrying their source. The report's ``config`` section is
:meth:`ConvertSpec.to_config`; :meth:`ConvertSpec.to_json` / :meth:`ConvertSpec.from_json` are the whole spec as
JSON (stored in every result and every ``.pt2`` amplite writes, and read back as a spec).

Every entry point builds one (``path``: ``module``, ``checkpoint``, ``llm``, ``training``); what an unset
option means on each is data, :data:`PATH_DEFAULTS`. ``run_pipeline`` takes the spec whole.

Layer: below the converter (the pipeline reads a spec), above its parts (:mod:`amplite.spec_parts`) and the
passes (it resolves fusion and builds :class:`~amplite.passes.range_guard.RangeRules`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from amplite.errors import ConfigError
from amplite.levels import FP8, LEVEL_ENV, Level, precision_name, resolve_level, split_precision
from amplite.ops.fusion_default import resolve as resolve_fuse
from amplite.passes.range_guard import RangeRules
from amplite.policy import Override, PrecisionPolicy, make_overrides
from amplite.spec_parts import (
    Fp8Spec,
    RangeSpec,
    as_is,
    as_json,
    fp8_spec,
    parse_dynamic_dims,
    range_spec,
    short,
    typed,
)

__all__ = ["PATH_DEFAULTS", "ConvertSpec", "EntryPath", "Fp8Spec", "RangeSpec", "parse_dynamic_dims"]

#: The conversion paths (entry points) and what an option left unset (None) means on each: one table, read by
#: :meth:`ConvertSpec.build`. ``fp8``'s default level is O2 on every path (``amplite.levels.resolve_level``).
#: ``checkpoint``: a streamed directory (O2 stores low-precision weights; O1 would write the source unchanged; no
#: BatchNorm to fold, no fusion of a meta-device trace); ``llm``: ``convert_llm``'s step program;
#: ``training``: ``prepare_training`` / ``check --train-steps`` (BatchNorm stays unfolded: its running statistics
#: are the user's buffers).
PATH_DEFAULTS: dict[str, dict[str, Any]] = {
    "module": {"precision": "fp16", "level": Level.O1, "fuse_contractions": "auto", "fold_batchnorm": True},
    "checkpoint": {"precision": "fp16", "level": Level.O2, "fuse_contractions": False, "fold_batchnorm": False},
    "llm": {"precision": "bf16", "level": Level.O2, "fuse_contractions": "auto", "fold_batchnorm": True},
    "training": {"precision": "bf16", "level": Level.O1, "fuse_contractions": False, "fold_batchnorm": False},
}
EntryPath = Literal["module", "checkpoint", "llm", "training"]


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
        path: The entry point that built the spec (a key of :data:`PATH_DEFAULTS`).
        module_prefix: Prefix of the traced module paths that patterns do not see (a checkpoint's wrapper).
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
    path: EntryPath = "module"
    module_prefix: str = ""

    @classmethod
    def build(
        cls,
        *,
        path: EntryPath = "module",
        precision: str | torch.dtype | None = None,
        level: str | Level | None = None,
        keep_fp32: Iterable[str | Override] = (),
        force_low: Iterable[str | Override] = (),
        low_precision_io: bool = False,
        dynamic_batch: bool = False,
        dynamic_dims: Sequence[str] | Mapping[str, Sequence[int]] = (),
        fuse_contractions: bool | str | None = None,
        range_rules: bool | None = None,
        data_max: float = RangeRules.data_max,
        max_reduction_depth: int | None = RangeRules.max_reduction_depth,
        range_percentile: float | None = None,
        fold_batchnorm: bool | None = None,
        gpu_profile: str = "H100",
        calibrated: bool = False,
        module_prefix: str = "",
        level_name: str = "--level",
    ) -> ConvertSpec:
        """The spec of ``amplite.convert``'s keyword arguments (same names; ``calibrated``: calibration data was
        given, which makes FP8's activation scales static). ``precision``, ``level``, ``fuse_contractions`` and
        ``fold_batchnorm`` left None take ``path``'s default (:data:`PATH_DEFAULTS`; ``level``: after
        ``AMPLITE_LEVEL``). ``level_name``: how an error names the level (a CLI flag or an API argument).

        Raises:
            ConfigError: For the first value that is not valid, with the fix.
        """
        if path not in PATH_DEFAULTS:
            raise ConfigError(f"unknown conversion path {path!r}", f"use one of: {', '.join(PATH_DEFAULTS)}")
        default = PATH_DEFAULTS[path]
        precision = default["precision"] if precision is None else precision
        source = "argument" if level is not None else (LEVEL_ENV if os.environ.get(LEVEL_ENV) else "default")
        low, fp8 = split_precision(precision)
        resolved = resolve_level(level, precision, level_name)  # FP8's default level: O2
        if source == "default" and not fp8:
            resolved = default["level"]
        if fp8 and resolved is Level.O0:
            raise ConfigError("--precision fp8 at O0 converts nothing", "use --level O2 (fp8's default) or O1/O3")
        fuse_choice = default["fuse_contractions"] if fuse_contractions is None else fuse_contractions
        fuse, fuse_reason = resolve_fuse(fuse_choice, low)  # measured per (GPU, backend, dtype)
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
            fold_batchnorm=bool(default["fold_batchnorm"] if fold_batchnorm is None else fold_batchnorm),
            gpu_profile=gpu_profile,
            fp8=Fp8Spec.of(calibrated) if fp8 else None,
            path=path,
            module_prefix=module_prefix,
        )

    @property
    def precision_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp8``."""
        return FP8 if self.fp8 is not None else precision_name(self.precision)

    def policy(self) -> PrecisionPolicy:
        """The precision policy of this spec."""
        fp8 = self.fp8.activations if self.fp8 is not None else ""
        return PrecisionPolicy(self.precision, self.level, self.overrides, self.low_precision_io, fp8=fp8,
                               module_prefix=self.module_prefix)  # fmt: skip

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

    def to_json(self) -> dict[str, Any]:
        """The whole spec as a JSON object (every field; :meth:`from_json` reads it back equal)."""
        return {f.name: _ENCODE.get(f.name, as_is)(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> ConvertSpec:
        """The spec :meth:`to_json` wrote (e.g. read back from a ``.pt2``), checked field by field.

        Raises:
            ConfigError: Not an object of exactly the spec's fields, or a value of the wrong type or range.
        """
        names = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping) or set(data) != set(names):
            odd = sorted(set(data) ^ set(names)) if isinstance(data, Mapping) else [type(data).__name__]
            raise ConfigError(f"not a ConvertSpec record (fields missing or unknown: {short(odd)})",
                              "write it with ConvertSpec.to_json")  # fmt: skip
        values = {}
        for name in names:
            try:
                values[name] = _DECODE[name](data[name])
            except (TypeError, ValueError, KeyError, AttributeError, ConfigError) as exc:
                raise ConfigError(f"ConvertSpec field {name!r} is not valid: {short(data[name])}",
                                  "write it with ConvertSpec.to_json") from exc  # fmt: skip
        return cls(**values)


def _override(v: Mapping[str, Any]) -> Override:
    if set(v) != {f.name for f in fields(Override)} or v["action"] not in ("keep_fp32", "force_low"):
        raise ValueError(v)
    return Override(v["action"], typed(str)(v["pattern"]), v["source"], typed(str)(v["why"]))


def _dims(v: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((typed(str)(k), tuple(typed(int)(d) for d in typed(list)(ds))) for k, ds in v.items())


def _low_dtype(v: Any) -> torch.dtype:
    low, fp8 = split_precision(typed(str)(v))
    if fp8:  # the low dtype is fp16 or bf16; FP8 is the ``fp8`` field
        raise ValueError(v)
    return low


def _path(v: Any) -> str:
    if v not in PATH_DEFAULTS:
        raise ValueError(v)
    return v


#: How each field that is not plain JSON is written; the rest are written as they are.
_ENCODE: dict[str, Any] = {
    "precision": precision_name,
    "level": lambda v: v.value,
    "overrides": lambda v: [{f.name: getattr(r, f.name) for f in fields(r)} | {"source": r.source.value} for r in v],
    "dynamic_dims": lambda v: {k: list(d) for k, d in v},
    "ranges": as_json,
    "fp8": as_json,
}
#: How each field is read back and checked (every field: a test compares the keys with the dataclass's).
_DECODE: dict[str, Any] = {
    "precision": _low_dtype,
    "level": lambda v: Level(typed(str)(v)),
    "level_source": typed(str),
    "overrides": lambda v: tuple(_override(typed(dict)(r)) for r in typed(list)(v)),
    "low_precision_io": typed(bool),
    "dynamic_batch": typed(bool),
    "dynamic_dims": lambda v: _dims(typed(dict)(v)),
    "fuse": typed(bool),
    "fuse_reason": typed(str),
    "ranges": range_spec,
    "fold_batchnorm": typed(bool),
    "gpu_profile": typed(str),
    "fp8": fp8_spec,
    "path": _path,
    "module_prefix": typed(str),
}
