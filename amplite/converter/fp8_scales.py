"""Static FP8 activation scales chosen by measured error on the calibration data (``--precision fp8``).

``amax / 448`` maps an activation's largest calibrated magnitude onto e4m3's largest value. It is one of
``amax · 2^(k/8)`` for ``k = 15 … -24`` (from almost four times amax down to an eighth of it, in eighth-octave
steps: every alignment of the top octave also appears one octave higher),
and each candidate's error is measured, not modelled: every calibration batch runs once more through the
FP32 graph and each FP8-eligible input (the activation operand of a product with a stored 2-D weight,
``op_tables.FP8_WEIGHT_OPS``) is quantized to e4m3 and back with every candidate scale, the squared errors
summed over all batches — the "mse" calibrator of NVIDIA ModelOpt, on the full tensors.

What it changes: e4m3 is a float format, so a scale changed by a power of two moves every value by whole
binades and the error repeats with period two (up to subnormals); what the scale decides within an octave
is where the largest values fall on the 3-bit mantissa grid. Where a few large values dominate the error (a
heavy tail, an outlier channel) that alignment changes the activation's error by up to a factor of two;
for a Gaussian bulk by under 1 %. Among the candidates whose error is within ``TIE`` (1 %, 0.04 dB) of the
least, the largest wins: headroom above the calibrated maximum costs nothing measurable on the
calibration data and keeps a larger value at run time from saturating at ``448·scale``. Measured
(bench/RESULTS.md, "FP8 — models"): ViT-B/16's all-FP8 plan 19.6 dB against 18.9 with amax/448; served
images brighter than the calibration ones 28.8 against 26.6 dB (fx-cnn); elsewhere within ±1.2 dB, the
spread of scale choices on held-out data.

``amax`` is the range rules' (the maximum, or the ``--range-percentile`` value): the overflow rule
(``passes.fp8_sites``) still judges it, so an activation whose calibrated maximum that percentile misses
stays bf16 with its reason; a clip chosen here is one the measured error justifies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec

from amplite import op_tables
from amplite.ops.fp8_numerics import E4M3_MAX, FP8_DTYPE
from amplite.passes.fp8_sites import stored_weight
from amplite.passes.range_guard import ValueRange

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
#: Candidate amaxes per activation: ``amax · 2^(k/8)`` for ``k`` from ``HEADROOM`` down to ``-CLIP``.
HEADROOM, CLIP = 15, 24
#: Relative error within which a larger candidate is preferred (headroom at no measurable cost).
TIE = 0.01


def fp8_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes that feed a product with a stored 2-D weight as its activation operand."""
    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        spec = op_tables.FP8_WEIGHT_OPS.get(op_tables.op_name(node.target) or "")
        if node.op != "call_function" or spec is None or len(node.args) <= spec[1]:
            continue
        x = node.args[spec[0]]
        if isinstance(x, torch.fx.Node) and stored_weight(node.args[spec[1]]) is not None:
            names[x.name] = None
    return list(names)


def candidate_amaxes(amax: float) -> torch.Tensor:
    """The candidates for one activation, largest first (FP32)."""
    return amax * torch.exp2(torch.arange(HEADROOM, -CLIP - 1, -1, dtype=torch.float64) / 8).float()


def quantization_error(x: torch.Tensor, amaxes: torch.Tensor) -> torch.Tensor:
    """Summed squared error of ``x`` stored in e4m3 with each candidate's scale ``amax / 448`` (FP64 sums)."""
    x32 = x.detach().reshape(-1).float()
    x32 = x32[torch.isfinite(x32)]
    out = torch.empty(len(amaxes), dtype=torch.float64)
    for i, scale in enumerate((amaxes / E4M3_MAX).tolist()):
        q = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * scale
        out[i] = (q - x32).double().pow(2).sum()
    return out


def pick(amaxes: torch.Tensor, errors: torch.Tensor) -> float:
    """The largest of ``amaxes`` (largest first) whose error is within ``TIE`` of the least."""
    ok = errors <= errors.min() * (1 + TIE)
    return float(amaxes[int(torch.nonzero(ok)[0])])


def choose_input_scales(
    gm: torch.fx.GraphModule, batches: Iterable[Inputs], ranges: Mapping[str, ValueRange]
) -> dict[str, ValueRange]:
    """``ranges`` with ``fp8_amax`` set on every FP8-eligible input: the largest candidate within ``TIE`` of the
    least measured error (:func:`pick`).

    Args:
        gm: The calibrated FP32 GraphModule (not modified).
        batches: The calibration batches, as :func:`~amplite.converter.calibration.collect_ranges` took them.
        ranges: Its calibrated ranges (read; the returned mapping holds copies where a choice was made).

    Returns:
        A new mapping, in the same order, holding copies with ``fp8_amax`` set where a choice was made.
    """
    refs = {}
    for name in fp8_inputs(gm):
        r = ranges.get(name)
        if r is not None and r.max_abs > 0:
            refs[name] = r.percentile_abs if r.percentile_abs is not None else r.max_abs
    if not refs:
        return dict(ranges)
    cands = {n: candidate_amaxes(a) for n, a in refs.items()}
    errors = {n: torch.zeros(len(c), dtype=torch.float64) for n, c in cands.items()}
    spec = getattr(gm, "_in_spec", None)
    with torch.no_grad():
        for args, kwargs in batches:
            flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else [*args, *kwargs.values()]
            _Measure(gm, cands, errors).run(*flat)
    out = dict(ranges)
    for name, err in errors.items():
        r = ranges[name]  # a plain copy: a weight's lazy range (a product of two stored tensors) is no dataclass init
        fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(ValueRange)}
        out[name] = ValueRange(**{**fields, "fp8_amax": pick(cands[name], err)})
    return out


class _Measure(torch.fx.Interpreter):
    """Runs the FP32 graph and adds each watched value's candidate errors into ``errors``."""

    def __init__(self, gm: torch.fx.GraphModule, cands: dict[str, torch.Tensor],
                 errors: dict[str, torch.Tensor]) -> None:  # fmt: skip
        super().__init__(gm)
        self.cands, self.errors = cands, errors

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.cands and isinstance(out, torch.Tensor) and out.dtype.is_floating_point:
            self.errors[n.name] += quantization_error(out, self.cands[n.name])
        return out
