"""Static FP8 scales chosen by measured error on the calibration data (``--precision fp8`` with calibration).

Two choices, both measured on the calibration batches run once more through the FP32 graph:

**Activation scales** (one per tensor). ``amax / 448`` maps an activation's largest calibrated magnitude
onto e4m3's largest value. It is one of ``amax · 2^(k/8)`` for ``k = 15 … -24`` (from almost four times
amax down to an eighth of it, in eighth-octave steps: every alignment of the top octave also appears one
octave higher), and each FP8-eligible input (the activation operand of a product with a stored 2-D weight,
``op_tables.FP8_WEIGHT_OPS``) is quantized to e4m3 and back with every candidate scale, the squared errors
summed over all batches — the "mse" calibrator of NVIDIA ModelOpt, on the full tensors. e4m3 is a float
format, so a scale changed by a power of two moves every value by whole binades and the error repeats with
period two (up to subnormals); what the scale decides within an octave is where the largest values fall on
the 3-bit mantissa grid. Among the candidates whose error is within ``TIE`` (1 %, 0.04 dB) of the least,
the largest wins: headroom costs nothing measurable on the calibration data and keeps a larger value at run
time from saturating at ``448·scale``. Measuring the product's output error instead moved the held-out
per-layer SQNR of the fixtures by at most 0.25 dB either way (±0.1 dB on average): no gain, so the
objective stays the input's (bench/RESULTS.md, "FP8 — where static lost").

**Weight scales** (one per output channel). Each channel's scale maps ``amax_n · 2^(k/8)`` onto 448, ``k =
0 … 7`` (``amax/448`` and every alignment of the top octave above it: nothing saturates), chosen per
channel by the measured error of the product's *output* on the calibration activations, ``‖X (Ŵ_n −
W_n)ᵀ‖²`` (the output channel ``n`` depends on row ``n`` of the weight only, so the choice is exact per
channel). Every alignment gives a weight the same error on its own (a Gaussian weight: within 0.1 dB), but
the rounding errors of different alignments point in different directions, and the activations are far
from isotropic (a large common component): the alignment whose error the data does not see wins. Measured
(bench/RESULTS.md, "FP8 — models", on held-out inputs): about 1 dB per layer on ViT-B/16, whose all-FP8
plan went from 19.1 to 20.7 dB against per-tensor dynamic scaling's 19.5; static is above that baseline on
every model measured there. ``X`` is the first calibration tokens, at most ``MAX_ROWS`` rows per input.

``amax`` is the range rules' (the maximum, or the ``--range-percentile`` value): the overflow rule
(``passes.fp8_sites``) still judges it, so an activation whose calibrated maximum that percentile misses
stays bf16 with its reason; a clip chosen here is one the measured error justifies.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec

from amplite import op_tables
from amplite.ops.fp8_numerics import E4M3_MAX, FP8_DTYPE, dequantize, quantize, scale_from_amax
from amplite.passes.fp8_sites import shared_weight, stored_weight
from amplite.passes.range_guard import ValueRange

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
#: Candidate amaxes per activation: ``amax · 2^(k/8)`` for ``k`` from ``HEADROOM`` down to ``-CLIP``.
HEADROOM, CLIP = 15, 24
#: Relative error within which a larger candidate is preferred (headroom at no measurable cost).
TIE = 0.01
#: Weight candidates per output channel: ``amax · 2^(k/8)`` for ``k = 0 … WEIGHT_STEPS - 1``.
WEIGHT_STEPS = 8
#: Calibration tokens (rows of an FP8 input) kept per input to measure the weight choice on.
MAX_ROWS = 1024


def fp8_products(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node, torch.Tensor]]:
    """``(product, activation, weight [out, in])`` of every product with a stored 2-D weight that may run in
    FP8 (not one shared with an embedding: ``passes.fp8_sites.shared_weight`` keeps those bf16)."""
    out = []
    for node in gm.graph.nodes:
        spec = op_tables.FP8_WEIGHT_OPS.get(op_tables.op_name(node.target) or "")
        if node.op != "call_function" or spec is None or len(node.args) <= spec[1]:
            continue
        x, w = node.args[spec[0]], stored_weight(node.args[spec[1]])
        if not isinstance(x, torch.fx.Node) or w is None or shared_weight(w):
            continue
        tensor = operator.attrgetter(str(w.target))(gm)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.dtype.is_floating_point:
            out.append((node, x, tensor if spec[2] == "nk" else tensor.t()))
    return out


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


def weight_amaxes(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per output channel of ``w [out, in]``, the amax its scale maps onto 448: of ``amax_n · 2^(k/8)``,
    ``k = 0 … WEIGHT_STEPS - 1``, the one whose rounding error least changes the product's output on the
    activations ``x [rows, in]`` (``‖x (Ŵ_n − W_n)ᵀ‖²``; ties keep the smaller ``k``)."""
    w32, x32 = w.detach().float(), x.detach().float()

    def output_error(cand: torch.Tensor) -> torch.Tensor:
        scale = scale_from_amax(cand)[:, None]
        return (x32 @ (dequantize(quantize(w32, scale), scale) - w32).t()).double().pow(2).sum(dim=0)

    best = w32.abs().amax(dim=1)
    amax, least = best, output_error(best)
    for k in range(1, WEIGHT_STEPS):
        cand = amax * 2.0 ** (k / 8)
        err = output_error(cand)
        better = err < least
        best, least = torch.where(better, cand, best), torch.where(better, err, least)
    return best


def pick(amaxes: torch.Tensor, errors: torch.Tensor) -> float:
    """The largest of ``amaxes`` (largest first) whose error is within ``TIE`` of the least."""
    ok = errors <= errors.min() * (1 + TIE)
    return float(amaxes[int(torch.nonzero(ok)[0])])


def choose_input_scales(
    gm: torch.fx.GraphModule, batches: Iterable[Inputs], ranges: Mapping[str, ValueRange]
) -> dict[str, ValueRange]:
    """``ranges`` with ``fp8_amax`` set on every FP8-eligible input (the largest candidate within ``TIE`` of
    the least measured error, :func:`pick`) and ``fp8_weight_amax`` on every product with a stored 2-D
    weight (per output channel, :func:`weight_amaxes`).

    Args:
        gm: The calibrated FP32 GraphModule (not modified).
        batches: The calibration batches, as :func:`~amplite.converter.calibration.collect_ranges` took them.
        ranges: Its calibrated ranges (read; the returned mapping holds copies where a choice was made).

    Returns:
        A new mapping, in the same order, holding copies with the choices set where one was made.
    """
    products = fp8_products(gm)
    refs = {}
    for name in dict.fromkeys(x.name for _, x, _ in products):
        r = ranges.get(name)
        if r is not None and r.max_abs > 0:
            refs[name] = r.percentile_abs if r.percentile_abs is not None else r.max_abs
    if not refs:
        return dict(ranges)
    cands = {n: candidate_amaxes(a) for n, a in refs.items()}
    errors = {n: torch.zeros(len(c), dtype=torch.float64) for n, c in cands.items()}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in cands}
    spec = getattr(gm, "_in_spec", None)
    with torch.no_grad():
        for args, kwargs in batches:
            flat = tree_flatten_spec((args, kwargs), spec) if spec is not None else [*args, *kwargs.values()]
            _Measure(gm, cands, errors, rows).run(*flat)
    out = dict(ranges)
    for name, err in errors.items():
        out[name] = _with(ranges[name], fp8_amax=pick(cands[name], err))
    with torch.no_grad():
        for node, x, w in products:
            if rows.get(x.name) and node.name in ranges:
                x_rows = torch.cat(rows[x.name])
                out[node.name] = _with(out[node.name], fp8_weight_amax=weight_amaxes(w, x_rows))
    return out


def scale_counters(gm: torch.fx.GraphModule, ranges: Mapping[str, ValueRange]) -> dict[str, int]:
    """What the choice decided, for the calibration pass's counters (the report): how many activation
    scales and weight channels it set, and how many of each map more than their maximum onto 448."""
    out = dict.fromkeys(("fp8_input_scales", "fp8_input_scales_above_amax", "fp8_weight_channels",
                         "fp8_weight_channels_above_amax"), 0)  # fmt: skip
    for r in ranges.values():
        if r.fp8_amax is not None:
            out["fp8_input_scales"] += 1
            out["fp8_input_scales_above_amax"] += int(r.fp8_amax > (r.percentile_abs or r.max_abs))
    for node, _, w in fp8_products(gm):
        chosen = ranges[node.name].fp8_weight_amax if node.name in ranges else None
        if chosen is not None:
            out["fp8_weight_channels"] += chosen.numel()
            out["fp8_weight_channels_above_amax"] += int((chosen > w.detach().float().abs().amax(dim=1)).sum())
    return out


def _with(r: ValueRange, **changes: Any) -> ValueRange:
    """A copy of ``r`` with ``changes`` (a plain copy: a weight's lazy range is no dataclass init)."""
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(ValueRange)}
    return ValueRange(**{**fields, **changes})


class _Measure(torch.fx.Interpreter):
    """Runs the FP32 graph, adds each watched value's candidate errors into ``errors`` and keeps up to
    ``MAX_ROWS`` of its rows (tokens, strided over each batch) in ``rows``."""

    def __init__(self, gm: torch.fx.GraphModule, cands: dict[str, torch.Tensor],
                 errors: dict[str, torch.Tensor], rows: dict[str, list[torch.Tensor]]) -> None:  # fmt: skip
        super().__init__(gm)
        self.cands, self.errors, self.rows = cands, errors, rows

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.cands and isinstance(out, torch.Tensor) and out.dtype.is_floating_point:
            self.errors[n.name] += quantization_error(out, self.cands[n.name])
            if out.dim() >= 1 and out.numel():
                flat = out.detach().reshape(-1, out.shape[-1]).float()
                room = MAX_ROWS - sum(len(r) for r in self.rows[n.name])
                if room > 0:
                    flat = flat[:: -(-len(flat) // room)] if len(flat) > room else flat
                    self.rows[n.name].append(torch.nan_to_num(flat, posinf=0.0, neginf=0.0).clone())
        return out
