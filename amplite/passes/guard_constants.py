"""Constants the low dtype cannot hold: saturate mask fills, keep every other such op in FP32.

Models bake constants into the graph that fit FP32 but not fp16/bf16: mask fills of
``torch.finfo(torch.float32).min`` (-3.4e38, beyond even bf16's 3.39e38), ``-1e9`` fills, large additive
biases, ``clamp`` bounds. Computed in the low dtype such an op either fails (``masked_fill``: "value cannot
be converted to type c10::Half without overflow") or silently turns the constant into ±Inf (and ``-inf·0``
into NaN). Two passes handle them, one on each side of ``annotate_precision``:

* :class:`GuardConstants` (before it) finds every op with an unrepresentable constant operand: a Python
  scalar, or a small constant tensor (a lifted ``torch.tensor(...)``) — and, for creation ops (``full``,
  ``scalar_tensor``…) whose fill is unrepresentable, their floating-point consumers. A *saturable* one —
  a fill (``masked_fill``, ``where``, ``fill``, ``full``…) of an extreme value (|v| ≥ 2^120: a
  ``finfo.min``/``finfo.max`` stand-in for ±Inf) or a ``clamp`` bound — is marked for :class:`SaturateFills`;
  every other is flagged ``meta['amplite_range'] = "range:constant …"``, which ``annotate_precision``
  turns into an FP32 decision (user overrides still win). Counters: ``kept_fp32:range:constant``.
* :class:`SaturateFills` (after it) replaces each marked constant, where the op (or, for creation ops, a
  consumer) computes in the low dtype, by the low dtype's extreme finite value of the same sign (fp16:
  ±65504; bf16: ±3.39e38). Masking semantics are preserved: a filled position still loses every softmax
  (an FP32 island) against finite scores, and a fully masked row still gives the uniform distribution FP32
  gives; a clamp bound beyond the dtype's range is inactive either way. Counters: ``fills_saturated``,
  ``clamp_bounds_saturated``; ``details['saturated']`` names each node, op, old and new value and source.

Guarantees afterwards: no op that computes in the low dtype has a constant operand outside that dtype's
finite range, so none fails for it or turns it into ±Inf; ops that keep such a constant compute in FP32
with a ``range:constant`` reason.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.fx

from amplite import op_tables
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import cast_dtype, fake_value, is_float_tensor, source_line
from amplite.passes.meta import PRECISION_KEY, RANGE_KEY, SATURATE_KEY
from amplite.passes.range_guard import check_range_flags

_EXTREME = 2.0**120  # |v| at least this: the model meant "the end of the dtype", not a magnitude
_MAX_CONSTANT_NUMEL = 4096  # larger lifted tensors are data (tables, weights): the weight rules see them
_FILLS = frozenset(
    {
        "masked_fill.Scalar", "masked_fill.Tensor", "where.self", "where.ScalarOther", "where.ScalarSelf",
        "where.Scalar", "fill.Scalar", "fill_.Scalar", "full_like.default", "new_full.default",
        "index_fill.int_Scalar",
    }
)  # fmt: skip
_CREATION = frozenset({"full.default", "scalar_tensor.default", "full_like.default", "new_full.default"})
_CLAMPS = frozenset({"clamp.default", "clamp_min.default", "clamp_max.default", "hardtanh.default"})
_LIMITS = {dt: float(torch.finfo(dt).max) for dt in (torch.float16, torch.bfloat16)}


def _scalar_slots(node: torch.fx.Node) -> list[tuple[str, int | str, float]]:
    """(``args``/``kwargs``, position or name, value) of every numeric scalar operand of an ATen node."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    slots: list[tuple[str, int | str, float]] = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            where, key, value = "args", i, node.args[i]
        elif arg.name in node.kwargs:
            where, key, value = "kwargs", arg.name, node.kwargs[arg.name]
        else:
            continue
        kind = str(arg.type)
        numeric = "number" in kind or kind in ("float", "Optional[float]", "Tensor")  # Tensor: a wrapped scalar
        if numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
            slots.append((where, key, float(value)))
    return slots


def _constant_tensor(gm: torch.fx.GraphModule, node: Any) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    ok = isinstance(obj, torch.Tensor) and obj.dtype.is_floating_point and 0 < obj.numel() <= _MAX_CONSTANT_NUMEL
    # A meta tensor (a checkpoint planned from metadata) has no values to check.
    return obj if ok and obj.device.type != "meta" else None


def _largest_finite(t: torch.Tensor) -> float:
    a = t.detach().abs().double()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


class GuardConstants(PassBase):
    """Flag ops with constants the low dtype cannot hold (FP32) or mark them for saturation.

    Args:
        low_dtype: The conversion's low dtype (nothing to do for other dtypes).
    """

    name = "guard_constants"

    def __init__(self, low_dtype: torch.dtype) -> None:
        self.limit = _LIMITS.get(low_dtype)

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Before the plan: its flags and marks are facts the plan and ``saturate_fills`` read."""
        self.require_unplanned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Only fills, clamps and creation ops are marked for saturation; every flag is a range reason."""
        for node in gm.graph.nodes:
            if SATURATE_KEY in node.meta and (op_tables.op_name(node.target) or "") not in _CLAMPS | _FILLS | _CREATION:
                raise self.broken(f"node {node.name} is marked for saturation but is no fill, clamp or creation op")
        check_range_flags(self, gm)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        if self.limit is None:
            return PassResult(gm, False, counters)
        for node in gm.graph.nodes:
            if node.op != "call_function" or cast_dtype(node) is not None:
                continue
            op = op_tables.op_name(node.target) or ""
            bad = [s for s in _scalar_slots(node) if math.isfinite(s[2]) and abs(s[2]) > self.limit]
            saturable = op in _CLAMPS or (op in _FILLS | _CREATION and all(abs(v) >= _EXTREME for *_, v in bad))
            if bad and saturable:
                node.meta[SATURATE_KEY] = [(w, k) for w, k, _ in bad]
                counters["marked_for_saturation"] += 1
            elif bad and op in _CREATION:
                for user in node.users:  # the constant is an FP32 tensor: its low readers would get ±Inf
                    if is_float_tensor(user) or any(is_float_tensor(a) for a in user.all_input_nodes):
                        self._flag(user, f"range:constant {node.name}={bad[0][2]:.3g}", counters)
            elif bad:
                self._flag(node, f"range:constant {bad[0][2]:.3g}", counters)
            else:
                for a in node.all_input_nodes:
                    t = _constant_tensor(gm, a)
                    if t is not None and (biggest := _largest_finite(t)) > self.limit:
                        self._flag(node, f"range:constant {a.target} |c|={biggest:.3g}", counters)
                        break
        return PassResult(gm, False, counters)

    def _flag(self, node: torch.fx.Node, reason: str, counters: Counter[str]) -> None:
        if RANGE_KEY not in node.meta:  # a range rule's reason, when there is one, stays
            node.meta[RANGE_KEY] = reason + f">{self.limit:.5g}"
            counters["kept_fp32:range:constant"] += 1


class SaturateFills(PassBase):
    """Replace the marked constants by the low dtype's extreme finite value where the op computes low.

    Args:
        low_dtype: The conversion's low dtype.
    """

    name = "saturate_fills"

    def __init__(self, low_dtype: torch.dtype) -> None:
        self.low_dtype = low_dtype
        self.limit = _LIMITS.get(low_dtype, math.inf)

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """After the plan: whether a constant saturates depends on the dtype its op computes in."""
        self.require_planned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every saturation mark was consumed (saturated, or its op computes in FP32)."""
        for node in gm.graph.nodes:
            if SATURATE_KEY in node.meta:
                raise self.broken(f"node {node.name} still carries its saturation mark")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        done: list[dict[str, Any]] = []
        for node in gm.graph.nodes:
            slots = node.meta.pop(SATURATE_KEY, None)
            if not slots or not self._computes_low(node):
                continue
            op = op_tables.op_name(node.target) or str(node.target)
            args, kwargs = list(node.args), dict(node.kwargs)
            for where, key in slots:
                box: Any = args if where == "args" else kwargs
                old = float(box[key])
                box[key] = math.copysign(self.limit, old)
                done.append({"node": node.name, "op": op, "from": old, "to": box[key], "source": source_line(node)})
                counters["clamp_bounds_saturated" if op in _CLAMPS else "fills_saturated"] += 1
            node.args, node.kwargs = tuple(args), kwargs
        result = PassResult(gm, bool(done), counters)
        result.details = {"saturated": done} if done else {}  # type: ignore[attr-defined]
        return result

    def _computes_low(self, node: torch.fx.Node) -> bool:
        """The node (a creation op: one of its consumers) reads or writes the constant in the low dtype."""
        plan = node.meta.get(PRECISION_KEY) or {}
        if plan.get("dtype") == self.low_dtype:
            return True
        if op_tables.op_name(node.target) in _CREATION:
            for user in node.users:
                if (user.meta.get(PRECISION_KEY) or {}).get("dtype") == self.low_dtype:
                    return True
                val = fake_value(node)
                if cast_dtype(user) == self.low_dtype and isinstance(val, torch.Tensor):
                    return True
        return False
