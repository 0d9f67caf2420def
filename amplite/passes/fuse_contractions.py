"""Fuse data movement, scaling and bias around contractions into one ``amplite::contract``.

After this pass, each fused contraction (``mm``, ``bmm``, ``matmul``, ``linear``, ``addmm``, ``baddbmm``,
two-operand ``einsum``) is a single ``amplite::contract`` node whose einsum equation absorbs the
permutes, transposes, ``t``, ``contiguous``/``clone``, unsqueezes, squeezes, expands and the views/reshapes
that only split or merge adjacent dimensions on its inputs, constant scalings (``mul``/``div`` by a
Python number) on its inputs and output, and one bias ``add``/``sub`` on its output. What remains around
it are free views: one that splits a source's dimensions into the equation's modes, one on a bias, and
one that merges the (contiguous) result back to the original shape.

Guarantees:

* Values are unchanged up to rounding: every rewrite is exact in real arithmetic (see
  ``einsum_equation``); the fused result rounds once (FP32 accumulation, scaling and bias) where eager
  rounded after each op.
* A node that is a graph output or has users outside the chain is never absorbed: it stays, and the
  contraction reads it as its source (reason ``shared_intermediate`` / ``intermediate_is_graph_output``).
* Every new node has ``meta['val']`` (from the op's fake implementation under the graph's fake mode),
  the graph lints, and the module re-exports and saves with ``torch.export`` (load needs
  ``import amplite.ops`` first).

Precision: the pass runs after the precision passes and fuses only contractions whose operands and
result share a dtype in ``dtypes`` (fp16/bf16 by default), so it neither adds nor removes precision
decisions. A pure cast inside an operand's chain is kept as a cast of the source (moving data and
changing dtype commute), never dropped; a cast downstream of an absorbed scaling is not crossed, since
casting the unscaled value first could overflow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.fx

from amplite.ops.contract import parse_equation
from amplite.passes.base import PassBase, PassResult, call_function_nodes
from amplite.passes.contraction_chains import ASSERT_META, BIAS_ADDS, MOVEMENT, SCALES, Rejection, SymbolicExtents
from amplite.passes.contraction_rules import (
    CONTRACT,
    RULES,
    AddmmRule,
    ContractionMatch,
    ContractionRule,
    EinsumRule,
    Fusion,
    FusionContext,
    Inputs,
    LinearRule,
    MatmulRule,
    NoMatch,
    absorbed_kinds,
)
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand

# Rules, constants and ``Rejection`` live in ``contraction_rules``/``contraction_chains`` (the mode types in
# ``einsum_equation``); they stay importable from here.
__all__ = [
    "ASSERT_META",
    "BIAS_ADDS",
    "CONTRACT",
    "MOVEMENT",
    "RULES",
    "SCALES",
    "AddmmRule",
    "ContractionMatch",
    "ContractionRule",
    "EinsumRule",
    "FuseContractions",
    "Fusion",
    "FusionResult",
    "Inputs",
    "LinearRule",
    "MatmulRule",
    "ModeTable",
    "NoMatch",
    "NotFusable",
    "Operand",
    "Rejection",
]


@dataclass
class FusionResult(PassResult):
    """``PassResult`` plus the per-node records the report lists."""

    fused: list[Fusion] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)

    @property
    def details(self) -> dict[str, list[dict[str, object]]]:
        """Per-node records for the report: what was fused (with its equation) and what was not, and why."""
        return {"fused": [asdict(f) for f in self.fused], "rejected": [asdict(r) for r in self.rejections]}

    def note(self, rejections: tuple[Rejection, ...] | list[Rejection]) -> None:
        """Record rejections (each bumps ``rejected:<reason>``)."""
        for r in rejections:
            self.counters[f"rejected:{r.reason}"] += 1
            self.rejections.append(r)


class FuseContractions(PassBase):
    """Fuse contractions with their surrounding data movement, scaling and bias (see module docstring).

    For each node a rule's pattern matches, the rule's ``match`` gives a typed match or the rejection that
    says why not; a match that saves nothing is skipped (``skipped:nothing_to_absorb``) unless
    ``fuse_plain``; the rule's ``rewrite`` does the rest.

    Args:
        dtypes: Operand dtypes to fuse. Default fp16/bf16: the pass runs after the precision passes and
            leaves FP32 contractions alone; add ``torch.float32`` to fuse FP32 graphs (tests, benchmarks).
        fuse_plain: Also replace contractions that absorb nothing (a bare ``linear``); off by default,
            since cuBLAS already runs those optimally.
    """

    name = "fuse_contractions"

    def __init__(
        self, dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16), fuse_plain: bool = False
    ) -> None:
        self.dtypes = tuple(dtypes)
        self.fuse_plain = fuse_plain

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Each ``amplite::contract`` has a valid binary equation whose subscripts match its operands' and
        result's ranks (and sizes, where static), and one dtype for its operands and result."""
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is not CONTRACT:
                continue
            equation, a, b, c = n.args[:4]
            try:
                subs = parse_equation(equation)
            except (ValueError, TypeError, AttributeError) as exc:
                raise self.broken(f"contract {n.name} has an invalid equation: {exc}") from None
            vals = [a.meta.get("val"), b.meta.get("val"), n.meta.get("val")]
            if not all(isinstance(v, torch.Tensor) for v in vals):
                continue
            sizes: dict[str, object] = {}
            for s, v in zip(subs, vals, strict=True):
                if len(s) != v.dim():
                    raise self.broken(f"contract {n.name}: {equation!r} gives {s!r} to a rank-{v.dim()} value")
                for ch, extent in zip(s, v.shape, strict=True):
                    seen = sizes.setdefault(ch, extent)
                    if isinstance(seen, int) and isinstance(extent, int) and seen != extent:
                        raise self.broken(f"contract {n.name}: mode {ch!r} of {equation!r} has sizes {seen}, {extent}")
            bias = c.meta.get("val") if isinstance(c, torch.fx.Node) else None
            dts = {v.dtype for v in vals} | ({bias.dtype} if isinstance(bias, torch.Tensor) else set())
            if len(dts) != 1:
                raise self.broken(f"contract {n.name} mixes dtypes {sorted(str(d) for d in dts)}")

    def __call__(self, gm: torch.fx.GraphModule) -> FusionResult:
        """Fuse every eligible contraction in ``gm`` in place."""
        res = FusionResult(gm, False, Counter())
        ctx = FusionContext(self.dtypes, SymbolicExtents(gm.graph))
        erased: set[torch.fx.Node] = set()
        for node in call_function_nodes(gm):
            rule = next((r for r in RULES if node.target in r.targets), None)
            if rule is None or node in erased:
                continue
            found = rule.match(node, ctx)
            if isinstance(found, NoMatch):
                res.note((*found.notes, found.rejection))
                continue
            res.note(found.notes)
            if not found.pays and not self.fuse_plain:
                res.counters["skipped:nothing_to_absorb"] += 1
                res.rejections.append(Rejection(node.name, rule.name, "nothing_to_absorb", found.gain_detail))
                continue
            fusion, gone = rule.rewrite(gm.graph, found, ctx)
            erased.update(gone)
            res.fused.append(fusion)
            res.counters[f"fused:{rule.name}"] += 1
            for kind in absorbed_kinds(found):
                res.counters[f"absorbed:{kind}"] += 1
            res.modified = True
        if res.modified:
            gm.graph.lint()
            gm.recompile()
        return res
