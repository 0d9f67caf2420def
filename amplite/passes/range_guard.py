"""Range rules (analysis pass, runs before ``annotate_precision``): keep FP32 what the data says must be.

Guarantees afterwards: every node the rules flag carries ``meta['amplite_range']`` = a reason string, which
``annotate_precision`` turns into an FP32 decision (user overrides still win). The graph is not changed.

Rules (data in :class:`RangeRules`; defaults and their justification in docs/ranges.md):

* fp16 only — activations: a node whose output or any floating input reached more than ``data_max``
  in the FP32 reference stays FP32 (``range:activation``). 512 by default: above it fp16's spacing is
  0.5 or more, so small additive updates (residual branches, bias adds) are lost; it is also where
  fp16 is ~128× from overflow, a margin one matmul or square can use up.
* fp16 only — underflow: a node whose output or any floating input has more than ``data_underflow_share``
  (50%) of its non-zero elements below fp16's smallest normal 2^-14 stays FP32 (``range:underflow``):
  fp16 would store them as subnormals with fewer significant bits, or flush them to zero (a randomly
  initialised CNN whose activations shrink to ~1e-25 loses every output element). Estimated on a strided
  sample per value, and only for values whose largest |x| stays below 2^-10: rounding a subnormal errs
  by at most 2^-25, which for a value reaching 2^-10 is 2^-15 of its scale, less than fp16's own 2^-11
  rounding of its normal elements (a GELU's small cubic term stays low).
* fp16 only — weights: a reader of a weight with |w| > 65504 (fp16 max) stays FP32 (``range:weight-overflow``);
  so does a reader of a weight where more than ``underflow_share`` of the non-zero values are below
  2^-24 and would flush to zero (``range:weight-underflow``).
* any dtype — long reductions: a reduction that would run in low precision over more than
  ``max_reduction_depth`` elements stays FP32 (``range:reduction-depth``); at fp16's 11 bits a running
  sum of unit-size terms stops growing after ~2048 additions. Contractions are exempt: fp16/bf16 GEMMs,
  convolutions and ``amplite::contract`` accumulate in FP32 on every backend amplite targets.

One rule goes the other way: a ``pow`` with a small integer exponent (2 or 3: GELU-tanh's x³) is one or
two multiplies, not a transcendental, so it may follow its input's dtype instead of staying on the FP32
list: ``meta['amplite_range_low'] = "range:small-integer-pow"`` (counter ``low_ok:small-integer-pow``).
For fp16 only when the calibrated |x^n| of the node was seen and the activation rule did not flag it
(so x^n stays ≤ ``data_max``, far below 65504); bf16 has FP32's exponent range, no range is needed.
``annotate_precision`` applies it only when no reader of the power is itself FP32 (``x.pow(2).mean()``
of an RMSNorm keeps its FP32 squares).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx

from amplite import op_tables
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import cast_dtype, fake_value
from amplite.passes.meta import RANGE_KEY, RANGE_LOW_KEY

FP16_MAX = 65504.0
FP16_FLUSH = 2.0**-24  # below half of the smallest subnormal a value rounds to zero (or to 2^-24)
FP16_TINY = 2.0**-14  # fp16's smallest normal: below it a value keeps fewer than 11 significant bits
_SUBNORMALS_MATTER = 2.0**-10  # below this largest |x| subnormal rounding costs more than fp16's normal rounding
_SAMPLE = 1 << 20
_STAT_SAMPLE = 1 << 12
_REDUCTIONS = frozenset(op_tables.FP32_OPS["reduction"]) | frozenset(op_tables.FP32_OPS["softmax"])
_POW = torch.ops.aten.pow.Tensor_Scalar
#: Exponents for which ``pow`` is a multiply or two: exact enough to follow a low-precision input.
SMALL_POW_EXPONENTS = (2, 3)
SMALL_POW = "range:small-integer-pow"


@dataclass
class ValueRange:
    """Range of one node's value over all calibration batches.

    The maximum is exact (every overflow rule is a threshold on the largest finite |value|: one overflow
    is one Inf; a single ``aminmax`` pass per value). The underflow statistic is estimated on a strided
    sample of at most ``_STAT_SAMPLE`` elements per batch: it is a share, not a count.

    Attributes:
        max_abs: Largest finite |value| seen.
        sampled_nonzero: Non-zero elements in the samples.
        sampled_tiny: Of those, how many are below fp16's smallest normal (2^-14): stored in fp16 they
            lose precision (subnormals) or flush to zero.
        fp8_amax: The amax of this value's static FP8 scale, chosen by measured error on the calibration
            data (``amplite.converter.fp8_scales``); None where none was chosen (not an FP8 input).
        fp8_weight_amax: On a matrix product with a stored weight: per output channel, the amax its FP8
            weight scale maps onto 448, chosen by the measured error of this product's output on the
            calibration data (``[out]``, FP32); None: each channel's own maximum.
    """

    max_abs: float = 0.0
    sampled_nonzero: int = 0
    sampled_tiny: int = 0
    percentile_abs: float | None = None
    fp8_amax: float | None = None
    fp8_weight_amax: torch.Tensor | None = None

    def update(self, t: torch.Tensor, percentile: float | None = None) -> None:
        """Fold one tensor into the range (non-finite values are ignored).

        With ``percentile`` (e.g. 99.99), also the largest over batches of that percentile of |value|,
        estimated on a strided sample of at most 2^20 elements (one ``kthvalue``: the cost the option adds).
        """
        if percentile is not None and t.numel():
            flat = t.detach().reshape(-1)
            sample = flat[:: flat.numel() // _SAMPLE + 1] if flat.numel() > _SAMPLE else flat
            sample = sample[torch.isfinite(sample)].abs().float()
            if sample.numel():
                k = max(1, min(sample.numel(), math.ceil(percentile / 100.0 * sample.numel())))
                value = float(sample.kthvalue(k).values)
                self.percentile_abs = value if self.percentile_abs is None else max(self.percentile_abs, value)
        a = t.detach()
        if a.numel() == 0:
            return
        biggest = max_abs(a)  # on the tensor as laid out: flattening a transposed value would copy it
        if not math.isfinite(biggest):  # rare: only then pay for masking out NaN/Inf
            a = a[torch.isfinite(a)]
            if a.numel() == 0:
                return
            biggest = float(a.abs().max())
        self.max_abs = max(self.max_abs, biggest)
        if self.max_abs >= _SUBNORMALS_MATTER:
            return  # the underflow rule ignores this value: no need to sample it
        a = a.reshape(-1)
        sample = a[:: a.numel() // _STAT_SAMPLE + 1].abs() if a.numel() > _STAT_SAMPLE else a.abs()
        nonzero = sample > 0
        self.sampled_nonzero += int(nonzero.sum())
        self.sampled_tiny += int((nonzero & (sample < FP16_TINY)).sum())

    @property
    def tiny_share(self) -> float:
        """Share of the sampled non-zero values below fp16's smallest normal (0 when none were sampled)."""
        return self.sampled_tiny / self.sampled_nonzero if self.sampled_nonzero else 0.0


def max_abs(t: torch.Tensor) -> float:
    """max |t| in one pass without allocating |t| (aminmax propagates NaN, so the caller sees it)."""
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi))


@dataclass(frozen=True)
class RangeRules:
    """Thresholds of the range rules.

    Attributes:
        data_max: Largest |activation| kept in fp16.
        weight_max: Largest |weight| kept in fp16.
        underflow_share: Largest share of non-zero weights allowed to flush to zero in fp16.
        data_underflow_share: Largest share of a value's non-zero elements allowed below fp16's smallest
            normal (2^-14) before its producer and readers stay FP32.
        max_reduction_depth: Longest reduction allowed in low precision (None: no limit).
        percentile: Judge the activation rule on this percentile of |value| (e.g. 99.99) instead of the
            maximum, so rare outliers do not keep a node FP32; a value above fp16's 65504 still does (an
            overflow is an Inf whatever its share). None (default): the maximum.
    """

    data_max: float = 512.0
    weight_max: float = FP16_MAX
    underflow_share: float = 0.01
    data_underflow_share: float = 0.5
    max_reduction_depth: int | None = 4096
    percentile: float | None = None


def check_range_flags(p: PassBase, gm: torch.fx.GraphModule) -> None:
    """Postcondition of the passes that flag nodes: every ``RANGE_KEY`` is a non-empty reason (the plan keeps
    such a node FP32 and shows the reason) and no node also carries ``RANGE_LOW_KEY``."""
    for node in gm.graph.nodes:
        flag = node.meta.get(RANGE_KEY)
        if flag is None:
            continue
        if not isinstance(flag, str) or not flag:  # the plan reads a flag as a str that is set (truthy)
            raise p.broken(f"node {node.name} is flagged with {flag!r}, not a reason the plan can show")
        if RANGE_LOW_KEY in node.meta:
            raise p.broken(f"node {node.name} is flagged both to keep FP32 and as safe in low precision")


class RangeGuard(PassBase):
    """Flag nodes whose calibrated ranges make low precision unsafe.

    Args:
        ranges: Per-node value ranges of the FP32 reference (from ``collect_ranges``).
        rules: The thresholds.
        low_dtype: The conversion's low dtype (activation and weight rules apply to fp16 only).
    """

    name = "range_guard"

    def __init__(self, ranges: Mapping[str, ValueRange], rules: RangeRules, low_dtype: torch.dtype) -> None:
        self.ranges = ranges
        self.rules = rules
        self.low_dtype = low_dtype

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Before the plan: its flags are facts the plan reads."""
        self.require_unplanned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Each flag is a non-empty reason, and no node is both kept FP32 and cleared low."""
        check_range_flags(self, gm)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        fp16 = self.low_dtype == torch.float16
        weight_flags = self._weight_flags(gm) if fp16 else {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or cast_dtype(node) is not None:
                continue
            reason = (self._activation(node) if fp16 else None) or self._weights(node, weight_flags)
            reason = reason or (self._underflow(node) if fp16 else None)  # a weight's flush is the cause: say it
            reason = reason or self._depth(node)
            if reason:
                node.meta[RANGE_KEY] = reason
                counters["kept_fp32:" + reason.split(" ")[0]] += 1
            elif self._small_pow(node, fp16):
                node.meta[RANGE_LOW_KEY] = SMALL_POW
                counters["low_ok:small-integer-pow"] += 1
        return PassResult(gm, False, counters)

    def _small_pow(self, node: torch.fx.Node, fp16: bool) -> bool:
        """``x ** n`` for n in ``SMALL_POW_EXPONENTS``, with (fp16) a calibrated range for its output."""
        if node.target is not _POW or len(node.args) < 2 or isinstance(node.args[1], bool):
            return False
        n = node.args[1]
        if not isinstance(n, (int, float)) or float(n) not in SMALL_POW_EXPONENTS:
            return False
        if not fp16:
            return True
        r = self.ranges.get(node.name)
        return r is not None and r.max_abs <= self.rules.data_max

    def _activation(self, node: torch.fx.Node) -> str | None:
        limit = self.rules.data_max
        for n in (node, *node.all_input_nodes):
            r = self.ranges.get(n.name)
            if r is None or n.op == "get_attr":
                continue
            where = "output" if n is node else f"input {n.name}"
            if self.rules.percentile is not None and r.percentile_abs is not None:
                if r.max_abs > FP16_MAX:  # an outlier that overflows is an Inf, whatever the percentile says
                    return f"range:activation {where} |x|={r.max_abs:.3g}>65504"
                if r.percentile_abs > limit:
                    return f"range:activation {where} p{self.rules.percentile:g}|x|={r.percentile_abs:.3g}>{limit:g}"
            elif r.max_abs > limit:
                return f"range:activation {where} |x|={r.max_abs:.3g}>{limit:g}"
        return None

    def _underflow(self, node: torch.fx.Node) -> str | None:
        limit = self.rules.data_underflow_share
        for n in (node, *node.all_input_nodes):
            r = self.ranges.get(n.name)
            if r is not None and n.op != "get_attr" and r.max_abs < _SUBNORMALS_MATTER and r.tiny_share > limit:
                where = "output" if n is node else f"input {n.name}"
                return f"range:underflow {where} {r.tiny_share:.0%} of non-zeros <2^-14 (|x|max={r.max_abs:.3g})"
        return None

    def _weight_flags(self, gm: torch.fx.GraphModule) -> dict[str, str]:
        flags = {}
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            t = _fetch(gm, node.target)
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.numel() == 0:
                continue
            reason = weight_reason(t, self.rules)
            if reason is not None:
                kind, _, detail = reason.partition(" ")
                flags[node.name] = f"{kind} {node.target} {detail}"
        return flags

    @staticmethod
    def _weights(node: torch.fx.Node, flags: dict[str, str]) -> str | None:
        return next((flags[n.name] for n in node.all_input_nodes if n.name in flags), None)

    def _depth(self, node: torch.fx.Node) -> str | None:
        limit = self.rules.max_reduction_depth
        if limit is None or op_tables.op_name(node.target) not in _REDUCTIONS or not node.args:
            return None
        src, out = fake_value(node.args[0]), fake_value(node)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            return None
        try:
            if op_tables.op_name(node.target) in op_tables.FP32_OPS["softmax"] or "cum" in str(node.target):
                dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")  # required: one or the other
                depth = int(src.shape[dim])  # an unknown dim (None) raises TypeError: not judged
            else:
                depth = int(src.numel()) // max(1, int(out.numel()))
        except (TypeError, RuntimeError, IndexError):
            return None
        return f"range:reduction-depth {depth}>{limit}" if depth > limit else None


def _fetch(gm: torch.fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj





def weight_reason(t: torch.Tensor, rules: RangeRules) -> str | None:
    """The fp16 weight rule for one tensor: ``range:weight-overflow``/``-underflow`` reason, or None.

    One ``aminmax`` pass for the overflow half; the flush-to-zero share on a strided sample (a share,
    not a count, is needed), so a multi-GB weight costs one read and no copy of itself.
    """
    if not t.dtype.is_floating_point or t.numel() == 0:
        return None
    biggest = max_abs(t.detach())
    if biggest > rules.weight_max:
        return f"range:weight-overflow |w|={biggest:.3g}"
    flat = t.detach().flatten()
    a = flat[:: flat.numel() // _SAMPLE + 1].abs().float() if flat.numel() > _SAMPLE else flat.abs().float()
    nonzero = int((a > 0).sum())
    if nonzero:
        share = int(((a > 0) & (a < FP16_FLUSH)).sum()) / nonzero
        if share > rules.underflow_share:
            return f"range:weight-underflow {share:.1%} flush to zero"
    return None
