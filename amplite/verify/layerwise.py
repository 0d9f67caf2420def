"""Layer-wise error localisation: which nodes of the converted graph introduce error, and how much.

Both programs run once under a :class:`torch.fx.Interpreter` on the same batch. Each node of the converted
graph is paired with its reference node (same name and op, else same op, module path and occurrence;
amplite's casts stay unpaired) and two errors are measured:

- **accumulated**: the converted node's value against the reference's, each model on its own activations;
  this is the error that reached that point of the graph.
- **isolated** ("shadow", as in torch.ao's numeric suite): the converted node re-run on the *reference's*
  inputs, cast to the dtypes that node receives in the converted graph, against the reference's value.
  This is the error the node itself introduces. A node whose operands all arrive in their reference dtype
  computes exactly what the reference did, so it is not re-run (its isolated error is 0). Weights and
  buffers are the converted model's own (stored in low precision at O2/O3, or edited): they belong to the
  node.

NaN/Inf are attributed where they first appear: a node whose shadow output has NaN/Inf that the reference
lacks *introduces* them, unless its inputs already carried them straight from a producer's low-precision
output (then the producer is to blame and the node only *inherits* them). Overflow at one of amplite's
casts belongs to the consumer that asked for the low dtype. Nodes are ranked: introduced NaN/Inf first,
then lowest isolated SQNR. Only the first data batch is analysed; view ops (which copy no values) are
left out.

Discrete decisions (``topk``/``argmax``/``sort`` indices, see ``op_tables.DISCRETE_DECISION_OPS``) are
compared as decisions: the fraction of indices that agree with the reference's (``decisions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from amplite.passes.graph_utils import cast_dtype
from amplite.verify.compare import json_float
from amplite.verify.node_errors import NodeError, node_error
from amplite.verify.shadow import Inputs, Recorder, Shadow, flat_inputs, pair_nodes

# NodeError, node_error, pair_nodes and flat_inputs live in node_errors/shadow; they stay importable from here.
__all__ = ["Inputs", "LayerwiseResult", "NodeError", "analyze", "flat_inputs", "node_error", "pair_nodes"]


@dataclass
class LayerwiseResult:
    """The layer-wise analysis of one batch."""

    nodes: list[NodeError] = field(default_factory=list)
    paired: int = 0
    unpaired: list[str] = field(default_factory=list)
    seconds: float = 0.0
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def top(self, n: int = 10) -> list[NodeError]:
        """The ``n`` nodes that introduce the most error (none that introduce nothing)."""
        cands = [e for e in self.nodes if e.isolated and (e.introduces_nonfinite or e.isolated["sqnr_db"] < math.inf)]
        return sorted(cands, key=NodeError.rank_key)[:n]

    def layers(self) -> list[dict[str, Any]]:
        """Per-layer summary: worst accumulated and isolated SQNR of each layer, in graph order."""
        out: dict[str, dict[str, Any]] = {}
        for e in self.nodes:
            row = out.setdefault(
                e.layer,
                {
                    "layer": e.layer,
                    "nodes": 0,
                    "accumulated_sqnr_db": math.inf,
                    "isolated_sqnr_db": math.inf,
                    "nonfinite": False,
                },
            )
            row["nodes"] += 1
            if e.accumulated:
                row["accumulated_sqnr_db"] = min(row["accumulated_sqnr_db"], e.accumulated["sqnr_db"])
                row["nonfinite"] |= e.accumulated["new_nonfinite"] > 0
            if e.isolated:
                row["isolated_sqnr_db"] = min(row["isolated_sqnr_db"], e.isolated["sqnr_db"])
        return list(out.values())

    def to_dict(self, top_n: int = 10) -> dict[str, Any]:
        """The report section ``layerwise``."""
        return {
            "batch": 0,
            "paired_nodes": self.paired,
            "unpaired_converted_nodes": self.unpaired,
            "seconds": round(self.seconds, 4),
            "top_introducers": [e.to_dict() for e in self.top(top_n)],
            "layers": [pytree.tree_map(json_float, row) for row in self.layers()],
            "nodes": [e.to_dict() for e in self.nodes],
            "decisions": self.decisions,
        }


def analyze(
    reference: ExportedProgram | torch.fx.GraphModule,
    converted: ExportedProgram | torch.fx.GraphModule,
    ref_inputs: Inputs,
    conv_inputs: Inputs,
    low_dtype: torch.dtype | None = torch.float16,
) -> LayerwiseResult:
    """Layer-wise analysis of ``converted`` against ``reference`` on one batch.

    Args:
        reference: The FP32 program (or its ``.module()``, to reuse one already built).
        converted: The converted program (or its ``.module()``).
        ref_inputs: The batch as the reference takes it. conv_inputs: The same batch as the converted
            program takes it (low-precision I/O casts the float inputs).
        low_dtype: The target dtype for range statistics (None: no range statistics).
    """
    start = perf_counter()
    ref_gm = reference.module() if isinstance(reference, ExportedProgram) else reference
    conv_gm = converted.module() if isinstance(converted, ExportedProgram) else converted
    pairs = pair_nodes(ref_gm.graph, conv_gm.graph)
    rec = Recorder(ref_gm, low_dtype)
    with torch.no_grad():
        rec.run(*flat_inputs(ref_gm, ref_inputs))
        shadow = Shadow(conv_gm, pairs, rec)
        shadow.run(*flat_inputs(conv_gm, conv_inputs))
    computed = [n for n in conv_gm.graph.nodes if n.op == "call_function" and cast_dtype(n) is None]
    unpaired = [n.name for n in computed if n not in pairs]
    result = LayerwiseResult(shadow.records, sum(1 for n in computed if n in pairs), unpaired,
                             decisions=shadow.decisions)  # fmt: skip
    result.seconds = perf_counter() - start
    return result
