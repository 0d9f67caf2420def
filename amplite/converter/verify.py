"""Numeric verification: the converted model against the FP32 original, output by output.

Default tolerances (documented in docs/verification.md): one rounding of a value to fp16 costs about
71 dB of SQNR and to bf16 about 53 dB; a network compounds a few dozen such roundings. A float output
passes when it has no NaN/Inf that the reference lacks and its SQNR is at least 40 dB for fp16 (relative
error norm ≤ 1 %) or 25 dB for bf16 (≤ 5.6 %; bf16 keeps 8 bits of mantissa against fp16's 11), with a
cosine similarity of at least 0.999 (fp16) / 0.99 (bf16). Integer and bool outputs pass when at most
1 % of elements differ.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.errors import InputSpecError


@dataclass(frozen=True)
class Tolerance:
    """Pass/fail thresholds for one output.

    Attributes:
        min_sqnr_db: Lowest acceptable SQNR in dB.
        min_cosine: Lowest acceptable cosine similarity.
        max_mismatch: Largest acceptable fraction of differing elements (integer/bool outputs).
    """

    min_sqnr_db: float
    min_cosine: float
    max_mismatch: float = 0.01


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(min_sqnr_db=40.0, min_cosine=0.999),
    "bf16": Tolerance(min_sqnr_db=25.0, min_cosine=0.99),
}


@dataclass
class OutputMetrics:
    """Error of one output leaf of the converted model against the reference."""

    name: str
    shape: list[int]
    dtype: str
    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_rel: float = 0.0
    cosine: float = 1.0
    sqnr_db: float = math.inf
    mismatch: float = 0.0
    ref_nonfinite: int = 0
    out_nonfinite: int = 0
    passed: bool = True
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (infinite SQNR becomes the string "inf")."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = "inf" if v > 0 else ("-inf" if v < 0 else "nan")
        return d


def output_names(tree: Any) -> list[str]:
    """Readable names for each leaf of an output pytree: ``output``, ``output[0]``, ``output['logits']``."""
    leaves_with_path, _ = pytree.tree_flatten_with_path(tree)
    names = []
    for path, _leaf in leaves_with_path:
        suffix = "".join(str(k) for k in path)
        names.append("output" + suffix)
    return names


def compare(reference: Any, converted: Any, tolerance: Tolerance) -> list[OutputMetrics]:
    """Metrics for every tensor leaf of two output pytrees of the same structure."""
    ref_leaves = pytree.tree_leaves(reference)
    out_leaves = pytree.tree_leaves(converted)
    if len(ref_leaves) != len(out_leaves):
        raise InputSpecError(
            f"the converted model returned {len(out_leaves)} outputs, the reference {len(ref_leaves)}",
            "report this as an amplite bug with --debug output",
        )
    results = []
    for name, ref, out in zip(output_names(reference), ref_leaves, out_leaves, strict=True):
        if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor):
            results.append(tensor_metrics(name, ref, out, tolerance))
    return results


def tensor_metrics(name: str, ref: torch.Tensor, out: torch.Tensor, tol: Tolerance) -> OutputMetrics:
    """Error metrics of ``out`` against ``ref``; see the module docstring for the pass rule."""
    m = OutputMetrics(name, list(ref.shape), str(out.dtype).removeprefix("torch."))
    if ref.shape != out.shape:
        m.passed = False
        m.notes.append(f"shape differs: converted {list(out.shape)}")
        return m
    if not ref.dtype.is_floating_point:
        m.mismatch = float((ref != out.to(ref.dtype)).float().mean()) if ref.numel() else 0.0
        m.passed = m.mismatch <= tol.max_mismatch
        return m
    r, o = ref.detach().double(), out.detach().double()
    ref_finite, out_finite = torch.isfinite(r), torch.isfinite(o)
    m.ref_nonfinite = int((~ref_finite).sum())
    m.out_nonfinite = int((~out_finite).sum())
    if m.ref_nonfinite:
        m.notes.append(f"reference has {m.ref_nonfinite} NaN/Inf values: they are excluded from the metrics")
    new_nonfinite = int((ref_finite & ~out_finite).sum())
    if new_nonfinite:
        m.notes.append(f"{new_nonfinite} values are NaN/Inf in the converted output only")
    mask = ref_finite & out_finite
    r, o = r[mask], o[mask]
    if r.numel() == 0:
        m.passed = False
        m.notes.append("no finite values to compare")
        return m
    diff = (r - o).abs()
    m.max_abs = float(diff.max())
    m.mean_abs = float(diff.mean())
    significant = r.abs() >= 1e-3 * float(r.abs().max())
    m.max_rel = float((diff[significant] / r.abs()[significant]).max()) if significant.any() else 0.0
    rn, en = float(r.norm()), float((r - o).norm())
    m.sqnr_db = math.inf if en == 0 else (20 * math.log10(rn / en) if rn > 0 else -math.inf)
    denom = rn * float(o.norm())
    m.cosine = float(torch.dot(r.flatten(), o.flatten()) / denom) if denom > 0 else float(rn == 0)
    m.passed = not new_nonfinite and m.sqnr_db >= tol.min_sqnr_db and m.cosine >= tol.min_cosine
    return m


def run_model(model: Any, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """Run a module or callable on ``(args, kwargs)`` without autograd."""
    args, kwargs = inputs
    with torch.no_grad():
        return model(*args, **kwargs)
