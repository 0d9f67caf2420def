"""Numeric verification: the converted model against the FP32 original, output by output.

Default tolerances (rationale in docs/verification.md): one rounding of a value to fp16 costs about
71 dB of SQNR and to bf16 about 53 dB; a network compounds a few dozen such roundings. A float output
passes when it has no NaN/Inf that the reference lacks and its SQNR is at least 40 dB for fp16 (relative
error norm ≤ 1 %) or 25 dB for bf16 (≤ 5.6 %; bf16 keeps 8 bits of mantissa against fp16's 11), with a
cosine similarity of at least 0.999 (fp16) / 0.99 (bf16). FP8 (``--precision fp8``: e4m3 matrix products,
the rest bf16): e4m3 keeps 3 mantissa bits, so one rounding costs about 30 dB and a linear layer, which
rounds its activation and its weight, about 27 dB; a network compounds a few such layers in series, so
the default is bf16's 25 dB with cosine ≥ 0.99, met by the accuracy-budget search, which is on by default
for fp8 and moves the most harmful FP8 products back to bf16 (docs/fp8.md). Integer and bool outputs pass when at most
1 % of elements differ. A reference output with NaN never passes: there is nothing to compare against.

User criteria (``--tolerance``) replace those defaults: ``sqnr>=45``, ``top1>=0.999``, ``max_abs<=1e-2``,
``p95_abs<=1e-3``, ``allclose(atol=1e-3,rtol=1e-3)``, each optionally scoped to one output with
``NAME:`` (``logits:sqnr>=40``). Scoped criteria replace the unscoped ones for the outputs they name; a
scope that names no output is an error (exit 2), never a criterion silently dropped. Criteria, their
parser and the tolerances live in ``criteria`` (re-exported here).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.errors import InputSpecError
from amplite.verify.criteria import (
    ALIASES,
    DEFAULT_TOLERANCES,
    QUANTILE_METRIC,
    Criterion,
    Tolerance,
    check_scopes,
    parse_criterion,
    parse_tolerance,
)
from amplite.verify.numbers import encode_float

# The criteria and tolerances live in ``criteria``; they stay importable from here.
__all__ = [
    "ALIASES",
    "DEFAULT_TOLERANCES",
    "Criterion",
    "OutputMetrics",
    "Tolerance",
    "compare",
    "compare_batches",
    "json_float",
    "output_names",
    "parse_criterion",
    "parse_tolerance",
    "run_model",
    "tensor_metrics",
]


@dataclass
class OutputMetrics:
    """Error of one output leaf of the converted model against the reference (all batches together)."""

    name: str
    shape: list[int]
    dtype: str
    max_abs: float = 0.0
    mean_abs: float = 0.0
    p99_abs: float = 0.0
    max_rel: float = 0.0
    cosine: float = 1.0
    sqnr_db: float = math.inf
    mismatch: float = 0.0
    top1: float | None = None
    top5: float | None = None
    kl_div: float | None = None
    min_atol: float = 0.0
    min_rtol: float = 0.0
    ref_nonfinite: int = 0
    out_nonfinite: int = 0
    new_nonfinite: int = 0
    ref_nan: int = 0
    elements: int = 0  # of the output (all batches)
    compared: int = 0  # elements finite in both: the float metrics are computed on these only
    batches: int = 1
    passed: bool = True
    checks: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def value(self, c: Criterion) -> float | None:
        """The value criterion ``c`` is tested on (None when it does not apply to this output)."""
        if c.metric == "allclose":
            return self.extra.get(str(Criterion("allclose", ">=", 1, None, c.atol, c.rtol)))
        v = self.extra.get(c.metric, getattr(self, c.metric, None))
        return None if v is None else float(v)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (infinite or NaN floats become the strings "inf", "-inf", "nan")."""
        return pytree.tree_map(json_float, asdict(self))


#: A float as report.json holds it (non-finite: "inf", "-inf", "nan"); see :mod:`amplite.verify.numbers`.
json_float = encode_float


def output_names(tree: Any) -> list[str]:
    """Readable names for each leaf of an output pytree: ``output``, ``output[0]``, ``output['logits']``."""
    leaves_with_path, _ = pytree.tree_flatten_with_path(tree)
    return ["output" + "".join(str(k) for k in path) for path, _leaf in leaves_with_path]


def compare(reference: Any, converted: Any, tolerance: Tolerance) -> list[OutputMetrics]:
    """Metrics for every tensor leaf of two output pytrees of the same structure."""
    return compare_batches([(reference, converted)], tolerance)


def compare_batches(pairs: Sequence[tuple[Any, Any]], tolerance: Tolerance) -> list[OutputMetrics]:
    """Metrics over several batches: each output's values of all batches are judged together.

    Raises:
        InputSpecError: If the two models return different numbers of outputs.
        ConfigError: If a scoped criterion names no output of the model.
    """
    names = output_names(pairs[0][0])
    check_scopes(tolerance, names)
    columns: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in names]
    for reference, converted in pairs:
        ref_leaves, out_leaves = pytree.tree_leaves(reference), pytree.tree_leaves(converted)
        if len(ref_leaves) != len(out_leaves) or len(ref_leaves) != len(names):
            raise InputSpecError(
                f"the converted model returned {len(out_leaves)} outputs, the reference {len(ref_leaves)}",
                "compare models with the same outputs (or report this as an amplite bug with --debug)",
            )
        for col, ref, out in zip(columns, ref_leaves, out_leaves, strict=True):
            col[0].append(ref)
            col[1].append(out)
    results = []
    for name, (refs, outs) in zip(names, columns, strict=True):
        if all(isinstance(t, torch.Tensor) for t in refs + outs):
            m = tensor_metrics(name, _stack(refs), _stack(outs), tolerance, batch_shape=list(refs[0].shape))
            m.batches = len(refs)
            results.append(m)
    return results


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of all batches: rows of the last dimension when it agrees, else flat."""
    if len(ts) == 1:
        return ts[0]
    if all(t.dim() >= 1 and t.shape[-1] == ts[0].shape[-1] for t in ts):
        return torch.cat([t.detach().reshape(-1, t.shape[-1]) for t in ts])
    return torch.cat([t.detach().reshape(-1) for t in ts])


def tensor_metrics(
    name: str, ref: torch.Tensor, out: torch.Tensor, tol: Tolerance, batch_shape: list[int] | None = None
) -> OutputMetrics:
    """Error metrics of ``out`` against ``ref``, judged by ``tol.criteria_for(name)``."""
    m = OutputMetrics(name, batch_shape or list(ref.shape), str(out.dtype).removeprefix("torch."))
    if ref.shape != out.shape:
        m.passed = False
        m.notes.append(f"shape differs: converted {list(out.shape)}")
        return m
    floating = ref.dtype.is_floating_point or ref.dtype.is_complex
    criteria = tol.criteria_for(name, floating)
    m.elements = m.compared = ref.numel()
    if not floating:
        m.mismatch = float((ref != out.to(ref.dtype)).float().mean()) if ref.numel() else 0.0
        return _judge(m, criteria, tol, floating=False)
    r, o = ref.detach().double(), out.detach().double()
    ref_finite, out_finite = torch.isfinite(r), torch.isfinite(o)
    m.ref_nonfinite, m.out_nonfinite = int((~ref_finite).sum()), int((~out_finite).sum())
    m.ref_nan = int(torch.isnan(r).sum())
    m.new_nonfinite = int((ref_finite & ~out_finite).sum())
    if m.ref_nan:
        m.notes.append(f"the FP32 reference output has {m.ref_nan} NaN values: nothing to verify against")
    elif m.ref_nonfinite:
        m.notes.append(f"reference has {m.ref_nonfinite} ±Inf values: they are excluded from the metrics")
    if m.new_nonfinite:
        m.notes.append(f"{m.new_nonfinite} values are NaN/Inf in the converted output only")
    if r.dim() >= 1 and r.shape[-1] >= 2 and bool(ref_finite.all()) and bool(out_finite.all()):
        _class_metrics(m, r.reshape(-1, r.shape[-1]), o.reshape(-1, o.shape[-1]))
    mask = ref_finite & out_finite
    rm, om = r[mask], o[mask]
    m.elements, m.compared = r.numel(), rm.numel()
    if m.compared < m.elements:  # say so first: 62 dB on a quarter of the values is not 62 dB
        share = m.compared / m.elements if m.elements else 0.0
        m.notes.insert(0, f"metrics computed on the finite part only ({m.compared} of {m.elements} elements, "
                          f"{share:.1%}); {m.elements - m.compared} are NaN/Inf")  # fmt: skip
    if rm.numel() == 0:
        m.passed = False
        m.notes.append("no finite values to compare")
        m.sqnr_db, m.cosine = -math.inf, 0.0
        return _judge(m, criteria, tol, force_fail=True)
    diff = (rm - om).abs()
    m.max_abs, m.mean_abs = float(diff.max()), float(diff.mean())
    m.p99_abs = _quantile(diff, 99.0)
    # Elements without error are left out: their relative error is 0 (0/0 where the reference is all zero)
    significant = (rm.abs() >= 1e-3 * float(rm.abs().max())) & (diff > 0)
    m.max_rel = float((diff[significant] / rm.abs()[significant]).max()) if significant.any() else 0.0
    m.min_atol = m.max_abs
    zero = rm == 0
    if bool((diff[zero] > 0).any()):
        m.min_rtol = math.inf
    elif bool((~zero).any()):
        m.min_rtol = float((diff[~zero] / rm.abs()[~zero]).max())
    rn, en = float(rm.norm()), float(diff.norm())
    m.sqnr_db = math.inf if en == 0 else (20 * math.log10(rn / en) if rn > 0 else -math.inf)
    denom = rn * float(om.norm())
    m.cosine = float(torch.dot(rm, om) / denom) if denom > 0 else float(rn == float(om.norm()))
    for c in criteria:
        if (q := QUANTILE_METRIC.match(c.metric)) and c.metric != "p99_abs":
            m.extra[c.metric] = _quantile(diff, float(q["q"]))
        elif c.metric == "allclose":
            close = diff <= c.atol + c.rtol * rm.abs()
            m.extra[str(Criterion("allclose", ">=", 1, None, c.atol, c.rtol))] = float(close.double().mean())
    return _judge(m, criteria, tol, force_fail=bool(m.ref_nan))


def _quantile(values: torch.Tensor, q: float) -> float:
    """The q-th percentile (nearest rank; ``kthvalue`` has no size limit, unlike ``torch.quantile``)."""
    k = max(1, min(values.numel(), math.ceil(q / 100 * values.numel())))
    return float(values.reshape(-1).kthvalue(k).values)


def _class_metrics(m: OutputMetrics, r: torch.Tensor, o: torch.Tensor) -> None:
    """Top-1/top-5 agreement and KL(softmax(ref) ‖ softmax(out)) over the last dimension."""
    ref_top = r.argmax(-1)
    m.top1 = float((o.argmax(-1) == ref_top).double().mean())
    if r.shape[-1] > 5:
        m.top5 = float((o.topk(5, dim=-1).indices == ref_top[:, None]).any(-1).double().mean())
    lp, lq = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
    m.kl_div = max(0.0, float((lp.exp() * (lp - lq)).sum(-1).mean()))


def _judge(
    m: OutputMetrics, criteria: list[Criterion], tol: Tolerance, floating: bool = True, force_fail: bool = False
) -> OutputMetrics:
    """Apply the criteria. One whose metric does not exist for this output (``top1`` of a vector) fails
    when it was scoped to it (the user asked for it) and is skipped otherwise; when that leaves nothing
    but the NaN/Inf check, the default rule applies, so no output passes unjudged."""
    m.passed = not force_fail
    applicable = [c for c in criteria if m.value(c) is not None or c.output is not None]
    if floating and all(c.metric == "new_nonfinite" for c in applicable):
        criteria = [*tol.defaults(), *applicable]
    for c in criteria:
        value = m.value(c)
        if value is None:
            if c.output is not None:
                m.passed = False
                m.checks.append({"criterion": str(c), "value": None, "passed": False})
                m.notes.append(f"{c.metric} cannot be computed for this output")
            continue
        ok = c.holds(value)
        m.passed &= ok
        m.checks.append({"criterion": str(c), "value": json_float(value), "passed": ok})
    return m


def run_model(model: Any, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """Run a module or callable on a copy of ``(args, kwargs)`` without autograd.

    The copy matters: models may update their inputs in place (a KV cache appends this step's keys), and
    every run must see the same inputs.
    """
    args, kwargs = copy.deepcopy(inputs)
    with torch.no_grad():
        return model(*args, **kwargs)
