"""Pass infrastructure, after torch.fx's and onnx-ir's pass managers.

A pass is an object with settings fixed in ``__init__`` and a ``__call__(gm) -> PassResult``. It may
rewrite the GraphModule in place; it keeps no state between calls. Every rewrite bumps a named counter in
the result, and the pipeline copies all counters into the report under the pass's ``name``. A result may
also carry ``details``, a JSON-able dict of per-node records (e.g. which candidates a fusion rejected and
why), which the report keeps beside the counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import torch.fx

from amplite.errors import AmpliteError, InternalError


@dataclass
class PassResult:
    """What one pass did.

    Attributes:
        graph_module: The (possibly rewritten) module.
        modified: Whether the graph changed.
        counters: Named counts of each kind of rewrite or decision.
    """

    graph_module: torch.fx.GraphModule
    modified: bool
    counters: Counter[str] = field(default_factory=Counter)


class Pass(Protocol):
    """A graph pass: settings in ``__init__``, work in ``__call__``."""

    name: str

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult: ...


@dataclass
class PassRecord:
    """One pass's result as kept for the report."""

    name: str
    modified: bool
    counters: dict[str, int]
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


class PassManager:
    """Runs passes in order, lints the graph after each and keeps their records.

    Args:
        passes: The passes to run, in order.
        lint: Run ``graph.lint()`` after each pass that modified the graph (catches broken rewrites
            where they happen rather than at re-export).
    """

    def __init__(self, passes: Sequence[Pass], lint: bool = True) -> None:
        self.passes = list(passes)
        self.lint = lint

    def __call__(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[PassRecord]]:
        """Run every pass on ``gm``; return the final module and one record per pass."""
        records: list[PassRecord] = []
        modified = False
        for p in self.passes:
            start = perf_counter()
            try:
                result = p(gm)
            except AmpliteError:
                raise
            except Exception as exc:  # a pass that crashes is amplite's bug, whatever the model
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise InternalError(f"amplite bug: pass {p.name} failed: {type(exc).__name__}: {first}") from exc
            gm = result.graph_module
            if result.modified:
                modified = True
                if self.lint:
                    gm.graph.lint()
            details = dict(getattr(result, "details", None) or {})
            records.append(PassRecord(p.name, result.modified, dict(result.counters), perf_counter() - start, details))
        if modified:  # passes work on the graph; its Python code is regenerated once, for whoever runs it next
            gm.recompile()
        return gm, records


def call_function_nodes(gm: torch.fx.GraphModule) -> Iterable[torch.fx.Node]:
    """The graph's ``call_function`` nodes, in order (a snapshot, safe to edit while iterating)."""
    return [n for n in gm.graph.nodes if n.op == "call_function"]
