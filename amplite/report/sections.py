"""The sections of report.json: one frozen type per top-level key, declared once, each with its builder.

A section is the value of one top-level key of the document (schema: amplite/schemas/report.schema.json).
Its type names the key (``key``) and has one builder, ``of(...)``, from the values amplite already has
(pass records, output metrics, tolerances, plain dicts for the free-form sections); ``to_json()`` is its
JSON value. :class:`~amplite.report.document.Report` is assembled from sections once
(:func:`~amplite.report.document.build_report`); a later stage (saving a file, verifying it, the budget
search, a gate) adds or replaces one with ``Report.attach(section)``, which refuses a type not in
:data:`SECTIONS`. A section's value is read-only (:mod:`amplite.report.frozen`).

To add a section: a subclass here with its ``key`` and ``of``, listed in :data:`SECTIONS`, and its key in
the schema (docs/architecture.md, "Where to add ...").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from amplite.passes.base import PassRecord
from amplite.report.frozen import freeze, thaw
from amplite.verify.compare import OutputMetrics, Tolerance

S = TypeVar("S", bound="Section")

#: The keys of a ``fp32_nodes`` entry (a plan entry without its mode and dtype).
FP32_NODE_KEYS = ("node", "op", "module", "source", "reason", "rule")


@dataclass(frozen=True)
class Section:
    """One top-level key of report.json and its (read-only) JSON value.

    Attributes:
        value: The JSON value (frozen on construction: dicts and lists refuse changes).
    """

    key: ClassVar[str]
    value: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", freeze(self.value))

    @classmethod
    def of(cls: type[S], value: Any) -> S:
        """The section from its JSON value (the builder of the free-form sections)."""
        return cls(value)

    def to_json(self) -> Any:
        """The section's JSON value: a plain, writable copy."""
        return thaw(self.value)

    def __copy__(self) -> Section:
        return self  # immutable: a copy is the section itself

    def __deepcopy__(self, memo: dict[int, Any]) -> Section:
        return self


def _rounded(seconds: Mapping[str, float]) -> dict[str, float]:
    return {k: round(float(v), 4) for k, v in seconds.items()}


class Source(Section):
    """``source``: what was converted (path, format, and facts such as the traced mode or shard count)."""

    key = "source"

    @classmethod
    def of(cls, path: Any, format: str, **facts: Any) -> Source:  # type: ignore[override]
        """The source from its path, format and the facts known about it (None values are left out)."""
        return cls({"path": str(path) if path is not None else path, "format": format,
                    **{k: v for k, v in facts.items() if v is not None}})  # fmt: skip


class Config(Section):
    """``config``: the conversion's settings (``ConvertSpec.to_config()`` or the checkpoint's own)."""

    key = "config"


class Passes(Section):
    """``passes``: one entry per pass run."""

    key = "passes"

    @classmethod
    def of(cls, records: Iterable[PassRecord]) -> Passes:  # type: ignore[override]
        """The section from the pass manager's records."""
        return cls([
            {"name": r.name, "modified": r.modified, "counters": r.counters, "seconds": round(r.seconds, 4)}
            | ({"details": r.details} if r.details else {})
            for r in records
        ])  # fmt: skip


class Graph(Section):
    """``graph``: node statistics of the FP32 and the converted graph."""

    key = "graph"

    @classmethod
    def of(cls, before: Mapping[str, Any], after: Mapping[str, Any]) -> Graph:  # type: ignore[override]
        """The section from ``graph_stats`` of both graphs."""
        return cls({"before": before, "after": after})


class Weights(Section):
    """``weights``: bytes of the weights before and after, and their ratio."""

    key = "weights"

    @classmethod
    def of(cls, bytes_before: int, bytes_after: int) -> Weights:  # type: ignore[override]
        """The section from the two byte counts (ratio 1.0 for a model without weights)."""
        ratio = round(bytes_after / bytes_before, 4) if bytes_before else 1.0
        return cls({"bytes_before": int(bytes_before), "bytes_after": int(bytes_after), "ratio": ratio})


class Plan(Section):
    """``plan``: one entry per planned node (mode, dtype, reason)."""

    key = "plan"


class Fp32Nodes(Section):
    """``fp32_nodes``: the plan's FP32 entries, with their reasons."""

    key = "fp32_nodes"

    @classmethod
    def of(cls, plan: Iterable[Mapping[str, Any]]) -> Fp32Nodes:  # type: ignore[override]
        """The section from the plan."""
        return cls([{k: p[k] for k in FP32_NODE_KEYS if k in p} for p in plan if p["mode"] == "fp32"])


class Timings(Section):
    """``timings``: seconds per phase (rounded to 0.1 ms)."""

    key = "timings"

    @classmethod
    def of(cls, seconds: Mapping[str, float]) -> Timings:  # type: ignore[override]
        """The section from phase -> seconds."""
        return cls(_rounded(seconds))

    def add(self, **seconds: float) -> Timings:
        """These timings with more phases (a phase given again is replaced)."""
        return Timings({**self.value, **_rounded(seconds)})


class Warnings(Section):
    """``warnings``: one line per warning."""

    key = "warnings"

    @classmethod
    def of(cls, lines: Iterable[str]) -> Warnings:  # type: ignore[override]
        """The section from the warning lines."""
        return cls([str(w) for w in lines])


class Verification(Section):
    """``verification``: the verdict and per-output metrics (module, gate) or the block-wise check."""

    key = "verification"

    @classmethod
    def of(cls, metrics: Iterable[OutputMetrics], tolerance: Tolerance | None,  # type: ignore[override]
           inputs: str = "example inputs", batches: int | None = None) -> Verification:  # fmt: skip
        """The section from the compared outputs and the tolerance they were judged by."""
        metrics = list(metrics)
        tol = {**vars(tolerance), "criteria": list(tolerance.criteria)} if tolerance is not None else None
        return cls({"inputs": inputs, **({"batches": batches} if batches is not None else {}), "tolerance": tol,
                    "passed": all(m.passed for m in metrics), "outputs": [m.to_dict() for m in metrics]})  # fmt: skip

    def folded(self, passed: bool) -> Verification:
        """This verification with another check's verdict folded into ``passed`` (both must hold)."""
        return Verification({**self.value, "passed": bool(self.value.get("passed", True)) and passed})


class Outputs(Section):
    """``outputs``: the model files written, one entry per path."""

    key = "outputs"

    def with_entries(self, *entries: Mapping[str, Any]) -> Outputs:
        """These outputs with ``entries`` (a later save to the same path replaces its entry)."""
        fresh = {str(e["path"]) for e in entries}
        return Outputs([*(e for e in self.value if e.get("path") not in fresh), *entries])


class Estimate(Section):
    """``estimate``: the roofline estimate of GPU time (amplite.estimate)."""

    key = "estimate"


class Build(Section):
    """``build``: how the converted ExportedProgram was built (direct or re-export)."""

    key = "build"


class VerificationAoti(Section):
    """``verification_aoti``: the written AOTInductor package against the FP32 reference."""

    key = "verification_aoti"


class VerificationOnnx(Section):
    """``verification_onnx``: the saved .onnx in ONNX Runtime against the FP32 reference."""

    key = "verification_onnx"


class Budget(Section):
    """``budget``: the accuracy-budget search (``fallback_search``)."""

    key = "budget"


class Llm(Section):
    """``llm``: the generation check and the KV cache (amplite.llm)."""

    key = "llm"

    def add(self, **facts: Any) -> Llm:
        """This section with more facts (a key given again is replaced)."""
        return Llm({**self.value, **facts})


class Streaming(Section):
    """``streaming``: memory of a streamed checkpoint conversion."""

    key = "streaming"

    @classmethod
    def of(cls, peak_rss_bytes: int, largest_shard_bytes: int, shards: int) -> Streaming:  # type: ignore[override]
        """The section from the process's peak RSS and the checkpoint's shards."""
        return cls({"peak_rss_bytes": peak_rss_bytes, "largest_shard_bytes": largest_shard_bytes, "shards": shards})


class WeightRules(Section):
    """``weight_rules``: modules a checkpoint's streamed weight statistics kept in FP32."""

    key = "weight_rules"

    @classmethod
    def of(cls, flagged: Mapping[str, str]) -> WeightRules:  # type: ignore[override]
        """The section from module path -> reason."""
        return cls([{"module": m, "reason": r} for m, r in flagged.items()])


class Fp8Checkpoint(Section):
    """``fp8_checkpoint``: what an FP8 checkpoint directory stores (amplite.checkpoint.fp8), its scales and size."""

    key = "fp8_checkpoint"


class Golden(Section):
    """``golden``: where a check's reference came from and how far the FP32 model drifted from it."""

    key = "golden"


class Baseline(Section):
    """``baseline``: the comparison with an accepted report (``check --baseline``)."""

    key = "baseline"

    @classmethod
    def of(cls, margin_db: float, regressions: list[dict[str, Any]],  # type: ignore[override]
           created: str | None) -> Baseline:  # fmt: skip
        """The section from the margin, the regressions found and the baseline's creation time."""
        return cls({"margin_db": margin_db, "regressions": regressions, "passed": not regressions,
                    "created": created})  # fmt: skip


class Check(Section):
    """``check``: a gate's verdict."""

    key = "check"

    @classmethod
    def of(cls, name: str, reasons: list[str]) -> Check:  # type: ignore[override]
        """The section from the check's name and its failure reasons (none: it passed, exit code 0)."""
        code = 1 if reasons else 0
        return cls({"name": name, "passed": code == 0, "exit_code": code, "reasons": list(reasons)})


class Layerwise(Section):
    """``layerwise``: the error localised node by node (amplite.verify.layerwise)."""

    key = "layerwise"


class Ranges(Section):
    """``ranges``: activation ranges against the low dtype (amplite.verify.ranges)."""

    key = "ranges"


class Gradients(Section):
    """``gradients``: parameter gradients of one backward pass (amplite.verify.gradcheck)."""

    key = "gradients"


class Training(Section):
    """``training``: ``check --train-steps``'s two training runs."""

    key = "training"


class Output(Section):
    """``output``: older reports' one file written (superseded by ``outputs``; read, never written)."""

    key = "output"


#: Every section a report may hold, by key; ``Report.attach`` refuses any other.
SECTIONS: dict[str, type[Section]] = {
    cls.key: cls
    for cls in (
        Source, Config, Passes, Graph, Weights, Fp32Nodes, Plan, Timings, Warnings, Verification, Estimate,
        Build, Outputs, VerificationAoti, VerificationOnnx, Budget, Llm, Streaming, WeightRules, Golden,
        Baseline, Check, Layerwise, Ranges, Gradients, Training, Output,
    )
}  # fmt: skip
SECTIONS[Fp8Checkpoint.key] = Fp8Checkpoint

__all__ = ["FP32_NODE_KEYS", "SECTIONS", "Section", *(cls.__name__ for cls in SECTIONS.values())]
