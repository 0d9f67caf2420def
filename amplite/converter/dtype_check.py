"""The precision sequence's postcondition: the rewritten graph computes in the dtypes the plan says it does.

The passes keep every node's ``meta['val']`` (its planned value: dtype, shape) up to date as they rewrite.
This checker runs the rewritten graph once under FakeTensor propagation (shapes and dtypes only, no
arithmetic: cost independent of tensor sizes) from the placeholders' planned values and compares each
node's real output dtype(s) with the planned ones.

Guarantees afterwards (when it returns): every node's output dtype at run time equals its planned dtype,
so no consumer receives operands of a dtype the plan did not give it — up to the first op FakeTensors
cannot run without values (counter ``stopped_early``; data-dependent shapes export recorded are fine).
The graph is not changed. On a mismatch it raises :class:`amplite.errors.InternalError` naming the node,
its op and source line: that is a bug in amplite's passes, never in the user's model.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from amplite import op_tables
from amplite.errors import InternalError
from amplite.passes.base import PassBase, PassResult
from amplite.passes.graph_utils import dtypes_of, source_line

#: FakeTensor propagation cannot go past these (values needed, or no fake kernel): the check stops there
#: (counter ``stopped_early``) instead of failing a conversion that may well be right.
_CANNOT_PROPAGATE = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    GuardOnDataDependentSymNode,
)


def _fake_mode(gm: torch.fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


class _Propagate(torch.fx.Interpreter):
    """Runs the graph on fake values: placeholders take their planned value, constants are fakeified."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Any, counters: Counter[str]) -> None:
        super().__init__(gm)
        self.mode = mode
        self.counters = counters

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.current_node.meta.get("val")  # type: ignore[attr-defined]

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            return self.mode.from_tensor(value, static_shapes=True)
        return value

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current_node = n
        try:
            out = super().run_node(n)
        except _CANNOT_PROPAGATE:
            raise
        except Exception as exc:
            raise InternalError(
                f"amplite bug: its rewritten graph fails at node {n.name} ({_op(n)}"
                f"{', ' + _where(n) if _where(n) else ''}): {type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:200]}"
            ) from exc
        if n.op in ("call_function", "get_attr", "placeholder") and n.target is not operator.getitem:
            self._compare(n, out)
        return out

    def _compare(self, n: torch.fx.Node, out: Any) -> None:
        planned, actual = dtypes_of(n.meta.get("val")), dtypes_of(out)
        if planned is None:
            return
        self.counters["nodes_checked"] += 1
        flat_p, flat_a = pytree.tree_leaves(planned), pytree.tree_leaves(actual)
        if len(flat_p) == len(flat_a) and all(p is None or p == a for p, a in zip(flat_p, flat_a, strict=True)):
            return
        where = _where(n)
        raise InternalError(
            f"amplite bug: node {n.name} ({_op(n)}{', ' + where if where else ''}) was planned to produce "
            f"{_fmt(planned)} but produces {_fmt(actual)} in the rewritten graph"
        )


def _where(n: torch.fx.Node) -> str:
    """The user's source line, else the innermost non-torch frame (a library's, e.g. transformers')."""
    found = source_line(n)
    if found:
        return found
    for line in reversed((n.meta.get("stack_trace") or "").splitlines()):
        line = line.strip()
        if line.startswith('File "') and "/torch/" not in line and "line " in line:
            fname, lineno = line.split('"')[1], line.split("line ")[1].split(",")[0]
            return f"{fname}:{lineno}"
    return ""


def _op(n: torch.fx.Node) -> str:
    return op_tables.op_name(n.target) or (n.op if n.op != "call_function" else str(n.target))


def _fmt(dtypes: Any) -> str:
    return str(dtypes).replace("torch.", "")


class CheckDtypes(PassBase):
    """Assert that every node's run-time output dtype equals its planned dtype (FakeTensor propagation).

    A check, not a rewrite: the precision sequence (:mod:`amplite.converter.sequence`) runs it as its
    ``postcondition``, after its last pass; a mismatch is that sequence's ``PostconditionError``.
    """

    name = "check_dtypes"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        mode = _fake_mode(gm)
        if mode is None:  # nothing was traced with fake values: nothing planned to check against
            return PassResult(gm, False, counters)
        try:
            # guards suppressed: a check must not specialize the program's dynamic dims in the shared
            # shape environment (a fake GRU kernel once pinned a dynamic batch to the example's size)
            quiet = mode.shape_env.suppress_guards() if mode.shape_env is not None else contextlib.nullcontext()
            with mode, quiet, torch.no_grad():
                _Propagate(gm, mode, counters).run()
        except InternalError as exc:  # re-raise without the "While executing" notes the interpreter appends
            raise InternalError(exc.problem, exc.fix) from exc.__cause__
        except _CANNOT_PROPAGATE:
            counters["stopped_early"] += 1
        return PassResult(gm, False, counters)
