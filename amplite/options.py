"""Every conversion option, defined once: :class:`ConvertOptions`.

``amplite.convert``'s keywords, ``amplite.check``'s conversion keywords, the CLI's conversion options and
a batch manifest's conversion keys are the fields of one frozen dataclass. Each field's metadata
(:class:`Option`) says how it is spelled on the command line and described in a manifest; nothing else
keeps a list of option names. :meth:`ConvertOptions.of` validates the names once (one-line
``ConfigError`` naming the known ones); :meth:`ConvertOptions.spec`, :meth:`~ConvertOptions.loading` and
:meth:`~ConvertOptions.verification` turn the options into the typed objects the pipeline reads.

Layer: above verify (a tolerance is a :class:`~amplite.verify.compare.Tolerance`) and the spec, below the
checkpoint path, the API and the gate.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from amplite.errors import ConfigError
from amplite.levels import Level, precision_name, split_precision
from amplite.passes.range_guard import RangeRules
from amplite.policy import Override
from amplite.spec import ConvertSpec, EntryPath
from amplite.verify.compare import DEFAULT_TOLERANCES, Tolerance, parse_tolerance

#: How a manifest value is checked (``amplite.batch.keys_table.check_value``).
Kind = Literal["string", "list", "bool", "number", "count", "integer", "level", "tolerance", "none"]
#: Conversion paths that take only some of the options.
Path_ = Literal["checkpoint", "training", "reference"]


@dataclass(frozen=True)
class Option:
    """How one conversion option appears outside Python.

    Attributes:
        help: The CLI help line (also the manifest's description when ``manifest`` is empty).
        flags: CLI spellings (``("--precision", "-p")``); empty: not a shared CLI conversion option (a
            command that needs it declares its own flag, e.g. ``convert --no-verify``).
        cli_type: The CLI parameter's type (what typer parses; ``bool | None`` with a ``--x/--no-x`` flag is a
            three-way switch).
        cli_default: The CLI default (None for "not given": the API's default then applies).
        kind: How a manifest value is checked; ``none``: not a manifest key.
        manifest: The manifest's description of a valid value, as errors quote it.
        paths: The conversion paths besides a model's that use the option: ``checkpoint`` (a streamed
            checkpoint directory), ``training`` (``check --train-steps``), ``reference`` (the FP32 reference
            export: how the model is read and traced; ``amplite golden`` takes only these). Any other option given
            to such a path is refused rather than ignored (:meth:`ConvertOptions.only_for`).
    """

    help: str
    flags: tuple[str, ...] = ()
    cli_type: Any = None
    cli_default: Any = None
    kind: Kind = "none"
    manifest: str = ""
    paths: tuple[Path_, ...] = ()


def _opt(default: Any, help: str, *flags: str, cli_type: Any = None, cli_default: Any = None, kind: Kind = "none",
         manifest: str = "", paths: tuple[Path_, ...] = ()) -> Any:  # fmt: skip
    """A field of :class:`ConvertOptions` with its :class:`Option` metadata."""
    meta = Option(help, flags, cli_type, cli_default, kind, manifest, paths)
    return field(default=default, metadata={"option": meta})


_PATTERNS = "a list of patterns"
_BOTH: tuple[Path_, ...] = ("checkpoint", "training")
#: What each partial path is called in errors, and the fix for an option it has no use for.
_PATH_TEXT: dict[str, tuple[str, str]] = {
    "checkpoint": ("a checkpoint directory", "drop it (checkpoints are streamed from their shards)"),
    "reference": ("the FP32 reference", "drop it (only how the model is read and traced applies)"),
    "training": ("--train-steps", "drop it: training uses --precision, --level, --keep-fp32, --force-low and how "
                 "to read the file"),
}
_BOOL = "true or false"


@dataclass(frozen=True)
class ConvertOptions:
    """A conversion's options as the user gives them (names, strings, patterns), before resolution.

    Attributes:
        precision: ``fp16``, ``bf16`` or ``fp8`` (or the dtype); None: fp16, except that ``check`` of a converted
            file reads the file's own. ``fp8``: matrix products with a stored weight in ``float8_e4m3fn``, the
            rest bf16; default level O2 (docs/fp8.md).
        level: ``O0``-``O3``; None reads ``AMPLITE_LEVEL``, else O1.
        keep_fp32: Patterns to keep in FP32 (``op:``, ``module:``, ``node:`` or unprefixed), or
            :class:`~amplite.policy.Override` rules carrying their own source (the budget search's pins).
        force_low: Patterns to force into low precision.
        low_precision_io: Graph inputs and outputs in the low dtype too.
        dynamic_batch: Make dim 0 of every input dynamic.
        dynamic_dims: More dynamic dims by input name: ``["ids:1"]`` or ``{"ids": [1]}``.
        fuse_contractions: Fuse matmul chains into ``amplite::contract``: ``auto`` (on only where a GPU
            measurement for this GPU, contraction backend and dtype shows it faster;
            ``amplite.ops.fusion_measurements``), ``on``/``off`` or a bool.
        trust_pickle: Allow unpickling (runs code from the file); see ``docs/security.md``.
        model_factory: ``module:callable`` building the model for a state-dict file.
        import_modules: Modules to import before loading (custom-op libraries, pytree types of a .pt2).
        verify: Compare the converted model with the FP32 one on the example inputs.
        tolerance: Verification thresholds: a ``Tolerance`` or criteria strings (``sqnr>=45``); None: the
            precision's default.
        range_rules: Keep FP32 what calibrated ranges say would overflow or lose precision (None: on at
            O1/O2, off at O0/O3). See ``amplite.passes.range_guard``.
        data_max: Largest |activation| kept in fp16 by the range rules.
        max_reduction_depth: Longest reduction the range rules allow in low precision.
        range_percentile: Judge the activation range rule on this percentile of |value| (e.g. 99.99).
        calibration: Batches for the range rules, a directory of batch files (``--calib DIR``) or
            ``"module:function"`` yielding batches (``--calib-loader``); default the example inputs.
        fallback_search: When verification fails, search for the fewest nodes to move back to FP32
            (``amplite.verify.budget``; FP8 nodes move back to bf16). None: on for ``precision="fp8"``
            (the budget search is part of its default contract, docs/fp8.md), off otherwise.
        max_trials: Bound on the search's conversions (default 2·log2(candidates) + 10).
        fold_batchnorm: Fold inference-mode BatchNorm into the preceding convolution.
        gpu_profile: GPU whose roofline the report's time estimate uses (H100, H200, A100, L4, RTX4090).
    """

    precision: str | torch.dtype | None = _opt(
        None, "fp16, bf16 or fp8 (default fp16; --train-steps: bf16; check --converted: the file's own).",
        "--precision", "-p",
        cli_type=str | None, kind="string", manifest="fp16, bf16 or fp8", paths=_BOTH,
    )
    level: str | Level | None = _opt(
        None, "O0-O3 (default: $AMPLITE_LEVEL, else O1).", "--level", "-l",
        cli_type=str | None, kind="level", manifest="O0, O1, O2 or O3", paths=_BOTH,
    )
    keep_fp32: Sequence[str | Override] = _opt(
        (), "Keep FP32: op:, module:, node: or any glob.", "--keep-fp32",
        cli_type=list[str], cli_default=[], kind="list", manifest=_PATTERNS, paths=_BOTH,
    )
    force_low: Sequence[str | Override] = _opt(
        (), "Force low precision (same patterns).", "--force-low",
        cli_type=list[str], cli_default=[], kind="list", manifest=_PATTERNS, paths=_BOTH,
    )
    trust_pickle: bool = _opt(
        False, "Allow unpickling (runs code from the file).", "--trust-pickle",
        cli_type=bool, cli_default=False, kind="bool", manifest=_BOOL, paths=("training", "reference"),
    )
    model_factory: str | None = _opt(
        None, "module:callable for a state dict.", "--model-factory",
        cli_type=str | None, kind="string", manifest="module:callable", paths=("training", "reference"),
    )
    import_modules: Sequence[str] = _opt(
        (), "Import MODULE first (custom-op library, pytree types of a .pt2). Repeatable.", "--import",
        cli_type=list[str], cli_default=[], kind="list", paths=("training", "reference"),
        manifest='a list of modules to import first (pytree types, custom ops), e.g. ["mypkg.ops"]',
    )
    dynamic_batch: bool = _opt(
        False, "Make dim 0 of every input dynamic.", "--dynamic-batch",
        cli_type=bool, cli_default=False, kind="bool", manifest=_BOOL, paths=("reference",),
    )
    dynamic_dims: Sequence[str] | Mapping[str, Sequence[int]] = _opt(
        (), "NAME:DIM[,DIM]: make these dims of input NAME dynamic (ids:1). Repeatable.", "--dynamic-dim",
        cli_type=list[str], cli_default=[], kind="list", paths=("reference",),
        manifest='a list of NAME:DIM[,DIM] specs, e.g. ["ids:1"]',
    )
    low_precision_io: bool = _opt(
        False, "Inputs and outputs in the low dtype too.", "--low-precision-io",
        cli_type=bool, cli_default=False, kind="bool", manifest=_BOOL, paths=("checkpoint",),
    )
    fuse_contractions: bool | str = _opt(
        "auto", "Fuse matmul chains into amplite::contract (default auto: off until a GPU run shows a gain).",
        "--fuse-contractions/--no-fuse-contractions", cli_type=bool | None, kind="bool", manifest=_BOOL,
    )
    range_rules: bool | None = _opt(
        None, "Keep FP32 what calibrated ranges flag (default: O1/O2).", "--range-rules/--no-range-rules",
        cli_type=bool | None, kind="bool", manifest="true or false (default: on at O1/O2)", paths=("checkpoint",),
    )
    data_max: float = _opt(
        RangeRules.data_max, "Largest |activation| kept in fp16.", "--data-max",
        cli_type=float, cli_default=RangeRules.data_max, kind="number",
        manifest="the largest |activation| kept in fp16 (a positive number)",
    )
    max_reduction_depth: int | None = _opt(
        RangeRules.max_reduction_depth, "Longest reduction kept in low precision.", "--max-reduction-depth",
        cli_type=int, cli_default=RangeRules.max_reduction_depth, kind="count",
        manifest="the longest reduction kept in low precision (a positive integer)",
    )
    range_percentile: float | None = _opt(
        None, "Judge the activation range rule on this percentile of |x| (99.99).", "--range-percentile",
        cli_type=float | None, kind="number", manifest="a percentile of |x| for the activation range rule (e.g. 99.99)",
    )
    fold_batchnorm: bool = _opt(
        True, "Fold BatchNorm into the preceding conv (--no-fold-batchnorm: keep it, in FP32).",
        "--fold-batchnorm/--no-fold-batchnorm", cli_type=bool, cli_default=True, kind="bool", manifest=_BOOL,
    )
    gpu_profile: str = _opt(
        ConvertSpec.gpu_profile, "GPU for the report's time estimate: H100, H200, A100, L4, RTX4090.",
        "--gpu-profile", cli_type=str, cli_default=ConvertSpec.gpu_profile, kind="string",
        manifest="the GPU of the report's time estimate (H100, H200, A100, L4, RTX4090)",
    )
    # The CLI and a manifest spell calibration as two options (calib DIR, calib_loader module:function): see
    # calibration_source().
    calibration: Iterable[Any] | str | Path | None = _opt(None, "Calibration batches for the range rules.")
    verify: bool = _opt(True, "Verify the converted model.", kind="bool", manifest=_BOOL, paths=("checkpoint",))
    tolerance: Tolerance | Sequence[str] | None = _opt(
        None, "Verification thresholds.", kind="tolerance",
        manifest="a table with min_sqnr_db, min_cosine, max_mismatch", paths=("checkpoint",),
    )
    fallback_search: bool | None = _opt(None, "Search the accuracy budget when verification fails (None: fp8 only).")
    max_trials: int | None = _opt(None, "Bound on the accuracy-budget search's conversions.")

    @classmethod
    def of(cls, options: ConvertOptions | None = None, **changes: Any) -> ConvertOptions:
        """``options`` (default: the defaults) with ``changes``; an unknown name is a one-line ``ConfigError``."""
        if options is not None and not isinstance(options, ConvertOptions):
            raise ConfigError(f"options= is a {type(options).__name__}, not ConvertOptions",
                              "pass amplite.ConvertOptions(...), or the options as keywords")  # fmt: skip
        known = cls.names()
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ConfigError(f"unknown conversion option(s) {', '.join(unknown)}", f"use {', '.join(known)}")
        return replace(options or cls(), **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in definition order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def described(cls) -> dict[str, Option]:
        """Each option's :class:`Option` (CLI spelling, manifest description), by name."""
        return {f.name: f.metadata["option"] for f in fields(cls)}

    @classmethod
    def default(cls, name: str) -> Any:
        """The API default of option ``name``."""
        f = next(f for f in fields(cls) if f.name == name)
        return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]

    def given(self) -> dict[str, Any]:
        """The options that differ from their defaults (for messages and forwarding to ``amplite.convert``)."""
        return {n: getattr(self, n) for n in self.names() if getattr(self, n) != self.default(n)}

    def only_for(self, path: Path_) -> ConvertOptions:
        """These options, checked for a conversion path that uses only some (:attr:`Option.paths`): one given
        (not at its default) that ``path`` has no use for is a ``ConfigError`` naming it."""
        described = self.described()
        if unused := [n for n in self.given() if path not in described[n].paths]:
            what, fix = _PATH_TEXT[path]
            raise ConfigError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to {what}", fix)
        return self

    def spec(self, path: EntryPath = "module", **extra: Any) -> ConvertSpec:
        """The resolved, validated conversion (``ConfigError`` for the first bad value).

        Every option that is a keyword of :meth:`ConvertSpec.build` is handed over by name; on a path that uses
        only some options (:attr:`Option.paths`: ``checkpoint``, ``training``) the others are left to the
        path's defaults (:data:`amplite.spec.PATH_DEFAULTS`). ``extra``: more ``build`` keywords (a checkpoint's
        ``module_prefix``).
        """
        described = self.described()
        partial = path in _PATH_TEXT
        given = {n: getattr(self, n) for n in _SPEC_KEYWORDS if not partial or path in described[n].paths}
        return ConvertSpec.build(path=path, calibrated=self.calibration is not None, **given, **extra)

    def loading(self) -> Loading:
        """How to read the model file."""
        return Loading(self.trust_pickle, self.model_factory, tuple(self.import_modules))

    def verification(self) -> Verification:
        """What to check after converting (a criteria-string tolerance is parsed for this precision)."""
        tol = self.tolerance
        if tol is not None and not isinstance(tol, Tolerance):
            tol = parse_tolerance(list(tol), self.precision_name)
        return Verification(self.verify, tol, self.fallback_search, self.max_trials)

    @property
    def precision_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp8`` (``ConfigError`` for anything else)."""
        if self.precision is None:
            return "fp16"
        low, fp8 = split_precision(self.precision)
        return "fp8" if fp8 else precision_name(low)

    def for_reference(self) -> ConvertOptions:
        """The options of the FP32 reference export: this model read and traced the same way, converted to
        nothing (O0) and not verified."""
        keep = {n: getattr(self, n) for n, o in self.described().items() if "reference" in o.paths}
        return ConvertOptions(level="O0", verify=False, **keep)


@dataclass(frozen=True)
class Verification:
    """What to check after converting: on/off, the tolerance, and the accuracy-budget search."""

    enabled: bool = True
    tolerance: Tolerance | None = None  # None: the precision's default
    fallback_search: bool | None = None  # None: on for fp8 (part of its default contract), off otherwise
    max_trials: int | None = None

    def check(self) -> None:
        """Refuse settings that contradict each other (one-line ``ConfigError``)."""
        if self.fallback_search and not self.enabled:
            raise ConfigError("the accuracy-budget search needs verification", "drop --no-verify (verify=False)")
        if self.max_trials is not None and self.max_trials < 2:
            raise ConfigError(
                f"max_trials={self.max_trials} is too small", "allow at least 2 (the worst node alone, then all)"
            )

    def searches(self, spec: ConvertSpec) -> bool:
        """Whether a conversion of ``spec`` that misses its tolerance runs the accuracy-budget search."""
        if self.fallback_search is not None:
            return self.fallback_search
        return self.enabled and spec.fp8 is not None

    def resolved(self, spec: ConvertSpec) -> Tolerance | None:
        """The tolerance verification judges by, or None when verification does not run."""
        return (self.tolerance or DEFAULT_TOLERANCES[spec.precision_name]) if self.enabled else None


@dataclass(frozen=True)
class Loading:
    """How to read a model file (a live module or program ignores these)."""

    trust_pickle: bool = False
    model_factory: str | None = None
    import_modules: Sequence[str] = ()


#: The options :meth:`ConvertSpec.build` takes by the same name (derived: the spec's own signature).
_SPEC_KEYWORDS = tuple(n for n in ConvertOptions.names() if n in inspect.signature(ConvertSpec.build).parameters)


def keyword_signature(func: Any, after: str) -> inspect.Signature:
    """``func``'s signature with every option as a keyword of its own, after parameter ``after``.

    ``amplite.convert(model, inputs, **options)`` then shows ``precision=``, ``level=``, ... in ``help()`` and
    in notebook completion, from the one definition; the ``**`` catch-all stays out of the shown signature.
    """
    own = [p for p in inspect.signature(func).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next(i for i, p in enumerate(own) if p.name == after)
    kw = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=ConvertOptions.default(f.name),
                            annotation=f.type) for f in fields(ConvertOptions)]  # fmt: skip
    shown = [*own[: at + 1], *kw, *own[at + 1 :]]
    return inspect.Signature(shown, return_annotation=inspect.signature(func).return_annotation)


def calibration_source(calib: str | Path | None, calib_loader: str | None) -> Path | str | None:
    """The ``calibration`` option from its two outside spellings: ``--calib DIR`` and ``--calib-loader
    module:function`` (a manifest's ``calib`` / ``calib_loader``); both at once is a ``ConfigError``."""
    if calib is not None and calib_loader is not None:
        raise ConfigError("--calib and --calib-loader are both given", "pass one source of calibration batches")
    return Path(calib) if calib is not None else calib_loader
