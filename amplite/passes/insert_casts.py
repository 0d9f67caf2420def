"""Pass 2: make the plan real by inserting casts.

Guarantees afterwards: every node planned by ``annotate_precision`` receives its floating-point operands
in its compute dtype, with two exceptions where torch's own promotion gives the same result: zero-dim
operands of ``follow`` nodes (promotion ignores them), and the narrower operands of a ``follow`` node in
``op_tables.PROMOTING_OPS`` (``add``/``mul``/``where``…: the kernel widens each element as it reads it,
so no FP32 copy is written; counter ``promotions_in_kernel``). There is at most ONE cast per (value,
dtype), shared by all consumers and placed before the first of them; graph outputs keep their original
dtype unless ``low_precision_io`` is set; every node's ``meta['val']`` carries its new dtype.
FP64 values are never touched.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from amplite import op_tables
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import dtypes_of, fake_value, make_cast, retype, value_dtype
from amplite.passes.meta import OUT_DTYPE_KEY, PRECISION_KEY

_PROMOTING = frozenset(op_tables.PROMOTING_OPS)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class InsertCasts(PassBase):
    """Insert the casts that the precision plan needs, and no more.

    Args:
        low_precision_io: Leave graph outputs in the dtype they were computed in instead of casting
            them back to their original dtype.
    """

    name = "insert_casts"

    def __init__(self, low_precision_io: bool = False) -> None:
        self.low_precision_io = low_precision_io

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """The plan is made: every node has its planned dtype."""
        self.require_planned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every planned node reads its floating operands in its compute dtype, but for the documented
        exceptions (FP64, zero-dim operands of ``follow`` nodes, in-kernel promotion of ``follow`` ops)."""
        for node in gm.graph.nodes:
            plan = node.meta.get(PRECISION_KEY)
            if node.op != "call_function" or not plan or plan["dtype"] is None:
                continue
            compute, follow = plan["dtype"], plan["mode"] == "follow"
            promotes = follow and compute == torch.float32 and op_tables.op_name(node.target) in _PROMOTING
            for arg in node.all_input_nodes:
                dt, val = value_dtype(arg), fake_value(arg)
                if dt is None or not dt.is_floating_point or dt in (compute, torch.float64) or promotes:
                    continue
                if follow and isinstance(val, torch.Tensor) and val.dim() == 0:
                    continue
                raise self.broken(
                    f"node {node.name} is planned in {_name(compute)} but reads {arg.name} in {_name(dt)}"
                )

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        counters: Counter[str] = Counter()
        casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        new_dtype: dict[torch.fx.Node, Any] = {}
        original: dict[torch.fx.Node, Any] = {}

        def cast_of(value: torch.fx.Node, dtype: torch.dtype, before: torch.fx.Node) -> torch.fx.Node:
            key = (value, dtype)
            if key not in casts:
                with graph.inserting_before(before):
                    casts[key] = make_cast(graph, value, dtype)
                new_dtype[casts[key]] = dtype
                counters["casts_inserted"] += 1
            else:
                counters["casts_shared"] += 1
            return casts[key]

        for node in list(graph.nodes):
            if node.op == "output":
                self._cast_outputs(node, new_dtype, original, cast_of)
                continue
            original[node] = dtypes_of(fake_value(node))
            new_dtype[node] = node.meta.get(OUT_DTYPE_KEY, original[node])
            plan = node.meta.get(PRECISION_KEY)
            if node.op == "call_function" and plan and plan["dtype"] is not None:
                compute, follow = plan["dtype"], plan["mode"] == "follow"
                promotes = follow and compute == torch.float32 and op_tables.op_name(node.target) in _PROMOTING

                def fix(
                    arg: Any, compute: torch.dtype = compute, follow: bool = follow, node: torch.fx.Node = node,
                    promotes: bool = promotes,
                ) -> Any:
                    if not isinstance(arg, torch.fx.Node):
                        return arg
                    dt = new_dtype.get(arg)
                    val = fake_value(arg)
                    if not isinstance(dt, torch.dtype) or not dt.is_floating_point or dt == compute:
                        return arg
                    if dt == torch.float64 or (follow and isinstance(val, torch.Tensor) and val.dim() == 0):
                        return arg
                    if promotes:
                        counters["promotions_in_kernel"] += 1
                        return arg
                    return cast_of(arg, compute, node)

                node.args = map_arg(node.args, fix)
                node.kwargs = map_arg(node.kwargs, fix)
            if node.op in ("call_function", "placeholder", "get_attr"):
                node.meta["val"] = retype(node.meta.get("val"), new_dtype[node])
        return PassResult(gm, counters["casts_inserted"] > 0, counters)

    def _cast_outputs(self, out: torch.fx.Node, new_dtype: dict, original: dict, cast_of: Any) -> None:
        if self.low_precision_io:
            return

        def back(arg: Any) -> Any:
            if not isinstance(arg, torch.fx.Node):
                return arg
            want, have = original.get(arg), new_dtype.get(arg)
            if isinstance(want, torch.dtype) and isinstance(have, torch.dtype) and want != have:
                return cast_of(arg, want, out)
            return arg

        out.args = map_arg(out.args, back)
