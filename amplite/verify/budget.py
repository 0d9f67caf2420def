"""Accuracy budget: when the rule-based plan misses the tolerance, move the fewest nodes back to FP32.

Under ``--precision fp8`` a node the plan ran in FP8 moves back to the low dtype (bf16) instead: a
``force_low`` pin (``budget:fp8-error``), which keeps it out of FP8 (:meth:`PrecisionPolicy.for_fp8`). For fp8
the search is part of the default contract: it runs without being asked (``Verification.searches``).

Candidates are the converted graph's low-precision nodes ranked by the error each one *introduces*
(the isolated "shadow" error of the layer-wise analysis). The search tries the worst node alone, then
all candidates (if even that fails, it stops: no subset can do better, and it reports the best plan
found), then bisects on how many of the ranked candidates to keep in FP32, and finally prunes that
prefix: each of its nodes, least isolated error first, goes back to low precision if the tolerance still
holds without it (``prune`` in the report: counts before and after). A trial reruns only the passes, on
the FP32 program (no export), with the calibrated ranges and FP32 reference outputs of the first
conversion, and runs the rewritten module: nothing is re-exported until the plan is chosen, and that plan
alone is converted and verified in full. Search trials are bounded by ``2·log2(N) + 10`` for N candidates,
prune trials by the prefix's length (at most 24); the report's ``trial_bound`` is their sum, or ``max_trials``,
which bounds both phases together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any

import torch

from amplite.converter.pipeline import lower_inputs, rewrite
from amplite.policy import Override, RuleSource
from amplite.spec import ConvertSpec
from amplite.verify.compare import compare, run_model
from amplite.verify.layerwise import analyze
from amplite.verify.numbers import decode_float


@dataclass
class Step:
    """One trial of the search."""

    trial: int
    kind: str  # plan, worst, all, bisect, prune
    moved: int  # how many ranked candidates were kept in FP32
    passed: bool
    worst_sqnr_db: float | str
    seconds: float


def fallback_search(
    result: Any, spec: ConvertSpec, *, convert: Callable[..., Any], max_trials: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """Search for a small set of nodes to keep in FP32 so that ``result`` meets its tolerance.

    Args:
        result: A verified ``ConversionResult`` that failed its tolerance.
        spec: The conversion that produced it. Each trial is this spec with the search's pins added
            (:class:`~amplite.policy.Override` rules whose source is the budget search).
        convert: ``convert(program, inputs, spec, reference_outputs)`` converting and verifying a spec
            (the API's, passed in: this layer never imports it), used once for the chosen plan.
        max_trials: Bound on all trials, search and prune (default: ``2·log2(N) + 10`` for the search plus
            the prune phase's bound).

    Returns:
        The converted result of the best plan found and the report's ``budget`` section (the caller attaches
        it: this layer sits below the report). The result passes when the search succeeded; otherwise it is
        the all-candidates plan (the most accurate tried).
    """
    start = perf_counter()
    low = spec.precision
    run_inputs = lower_inputs(result.inputs, low) if spec.low_precision_io else result.inputs
    ranked = _candidates(result, run_inputs, low)
    measured = dict(ranked)
    n = len(ranked)
    bound = max_trials if max_trials is not None else 2 * math.ceil(math.log2(max(n, 2))) + 10
    steps = [Step(0, "plan", 0, False, _worst(result.report.verified_outputs), 0.0)]
    cache: dict[frozenset[str], bool] = {}
    ranges = result.pipeline.ranges  # calibrated once, by the conversion that missed the tolerance
    fp8 = frozenset(p.node for p in result.report.planned if p.dtype == "float8_e4m3fn")

    def _pins(names: list[str]) -> list[Override]:
        return pins(names, fp8, measured)

    def trial(names: list[str], kind: str) -> bool:
        key = frozenset(names)
        if key in cache:
            return cache[key]
        t0 = perf_counter()
        module = rewrite(result.original, result.inputs, spec.with_overrides(_pins(names)), ranges=ranges).module
        metrics = compare(result.reference, run_model(module, run_inputs), result.tolerance)
        ok = all(m.passed for m in metrics)
        cache[key] = ok
        worst = _worst(metrics)
        steps.append(Step(len(steps), kind, len(names), ok, worst, round(perf_counter() - t0, 3)))
        return ok

    names = [name for name, _ in ranked]
    best_k, message = None, ""
    if n == 0:
        message = "no low-precision node introduces measurable error: nothing to move back to FP32"
    elif trial(names[:1], "worst"):
        best_k = 1
    elif n == 1 or not trial(names, "all"):
        message = (f"even with all {n} candidate nodes in FP32 the tolerance is not met; the report holds "
                   "the most accurate plan tried — loosen --tolerance or keep more in FP32 by hand")  # fmt: skip
    else:
        lo, hi = 1, n  # prefix lo fails, prefix hi passes
        while hi - lo > 1 and len(steps) - 1 < bound:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if trial(names[:mid], "bisect") else (mid, hi)
        best_k = hi
        if hi - lo > 1:
            message = f"stopped at the trial bound ({bound}); the plan found may keep more in FP32 than needed"
    chosen = names[: best_k if best_k is not None else n]
    before, search_trials = len(chosen), len(steps) - 1
    prune_bound = min(before, _PRUNE_MAX) if best_k is not None and before > 1 else 0
    if max_trials is not None:  # the caller's bound covers every trial, the prune phase's too
        prune_bound = min(prune_bound, max(0, max_trials - search_trials))
    # what bounds ``trials``: the search's bound (worst and all always run) plus the prune phase's
    total_bound = max(bound, min(n, 2)) + prune_bound if max_trials is None else max_trials
    chosen, prune_trials = _prune(chosen, lambda kept: trial(kept, "prune"), prune_bound)
    final = convert(result.original, result.inputs, spec.with_overrides(_pins(chosen)), result.reference)
    moved = set(chosen)
    budget = {
        "tolerance": asdict(result.tolerance),
        "passed": bool(final.passed),
        "candidates": n,
        "trials": len(steps) - 1,
        "trial_bound": total_bound,
        "search": {"trials": search_trials, "bound": bound},
        "moved_to_fp32": [
            {**_describe(result, name, sqnr), "to": "bfloat16" if name in fp8 else "float32"}
            for name, sqnr in ranked
            if name in moved
        ],
        "prune": {"before": before, "after": len(chosen), "trials": prune_trials, "bound": prune_bound},
        "steps": [asdict(s) for s in steps],
        "seconds": round(perf_counter() - start, 3),
        "message": message,
    }
    return final, budget


def pins(
    names: list[str], fp8: frozenset[str] = frozenset(), measured: dict[str, float | str] | None = None
) -> list[Override]:
    """The search's pins: ``node:`` rules whose source is the budget search, never the user's, so the report
    says who moved each node. A node the plan ran in FP8 moves to the low dtype (``budget:fp8-error``: a pin
    names its dtype, so it leaves FP8 and stays bf16, the reason holding its measured isolated SQNR); any other
    to FP32 (``budget:isolated-error``)."""
    measured = measured or {}

    def fp8_why(name: str) -> str:
        sqnr = measured.get(name)
        return f"fp8-error isolated-sqnr={sqnr:.1f}dB" if isinstance(sqnr, float) else "fp8-error"

    return [
        Override("force_low", f"node:{name}", RuleSource.BUDGET, why=fp8_why(name))
        if name in fp8
        else Override("keep_fp32", f"node:{name}", RuleSource.BUDGET, why="isolated-error")
        for name in names
    ]


#: At most this many prune trials (one per node of the bisected plan, least harmful first).
_PRUNE_MAX = 24


def _prune(chosen: list[str], passes: Callable[[list[str]], bool], bound: int) -> tuple[list[str], int]:
    """Return nodes of a passing FP32 set to low precision one at a time while the tolerance still holds.

    The bisection keeps a prefix of the ranking, which may hold nodes that are not needed (a subtraction
    that only shows its inputs' rounding ranks worst, yet keeping it FP32 cures nothing). Each node is tried,
    the one with the least isolated error first and the worst last (the likeliest to be needed); one that
    can go back to low precision is dropped for good. At most ``bound`` trials.
    """
    kept, tried = list(chosen), 0
    for name in reversed(chosen):
        if tried >= bound or len(kept) <= 1:
            break
        tried += 1
        rest = [k for k in kept if k != name]
        if passes(rest):
            kept = rest
    return kept, tried


def _candidates(result: Any, run_inputs: Any, low: torch.dtype) -> list[tuple[str, float | str]]:
    """Low-precision nodes that introduce error, worst first, as (name, isolated SQNR)."""
    lw = analyze(result.original, result.program, result.inputs, run_inputs, low)
    planned_low = {p.node for p in result.report.planned if p.mode != "fp32" and p.dtype != "float32"}
    ranked = []
    for e in lw.top(len(lw.nodes)):
        if e.node in planned_low and not e.exact:
            ranked.append((e.node, "nan" if e.introduces_nonfinite else e.isolated["sqnr_db"]))
    return ranked


def _worst(outputs: Iterable[Any]) -> float | str:
    """The worst output SQNR as report.json holds it: "nan" when an output became non-finite, "inf" exact.

    Args:
        outputs: The outputs' metrics, typed: the report's entries or :class:`OutputMetrics` (both have
            ``out_nonfinite`` and ``sqnr_db``, a float or its report encoding).
    """
    outputs = list(outputs)
    if any(o.out_nonfinite for o in outputs):
        return "nan"
    finite = [v for o in outputs if (v := decode_float(o.sqnr_db)) is not None and math.isfinite(v)]
    return min(finite) if finite else "inf"


def _describe(result: Any, name: str, sqnr: float | str) -> dict[str, Any]:
    plan = next((p for p in result.report.planned if p.node == name), None)
    return {"node": name, "op": plan and plan.op, "module": plan and plan.module, "source": plan and plan.source,
            "isolated_sqnr_db": sqnr}  # fmt: skip
