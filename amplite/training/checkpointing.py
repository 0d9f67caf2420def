"""Activation checkpointing in amplite's training graphs: recompute the marked regions, in the same plan.

``torch.export`` cannot keep ``torch.utils.checkpoint`` as such in a train-mode graph: the forward is
inlined and every activation would be saved for backward, silently spending the memory checkpointing was
meant to save. amplite therefore traces a checkpointed forward in two steps:

1. While tracing (:func:`mark_regions`), each outermost ``torch.utils.checkpoint`` call — the user's own,
   transformers' ``gradient_checkpointing_enable()`` (reentrant or not), FSDP's ``checkpoint_wrapper`` —
   runs its function directly and tags the graph nodes it produced with a region number
   (``node.meta["amplite_checkpoint"]``).
2. After amplite's passes (:func:`checkpoint_graph`), the train graph is split at the region boundaries
   (``torch.fx.passes.split_module``); each region becomes a submodule called through
   ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The region keeps the nodes amplite's
   passes put inside it (the casts of the precision plan), so the recomputation in backward runs the very
   same ops in the same dtypes; the RNG state is replayed, so dropout draws the same masks.

As with eager checkpointing, in-place updates inside a region (BatchNorm running statistics) happen again
when it is recomputed. Selective-checkpointing policies (``context_fn``) are not followed: a region is
recomputed whole.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.passes.split_module import split_module

KEY = "amplite_checkpoint"


@contextlib.contextmanager
def mark_regions() -> Iterator[dict[str, int]]:
    """While inside, ``torch.utils.checkpoint`` runs its function directly, tagging the traced nodes.

    Yields:
        ``{"regions": n}``: how many outermost checkpointed calls the trace went through.
    """
    import torch.utils.checkpoint as ckpt

    state = {"regions": 0, "depth": 0}
    real_fn, real_gen = ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator

    @contextlib.contextmanager
    def region() -> Iterator[None]:
        state["depth"] += 1
        outer = state["depth"] == 1  # a nested call is recomputed as part of the outer region
        mode = get_proxy_mode() if outer else None
        graph = mode.tracer.graph if mode is not None else None
        start = next(reversed(graph.nodes), None) if graph is not None else None
        try:
            yield
        finally:
            state["depth"] -= 1
        if graph is None:
            return
        state["regions"] += 1
        inside = start is None
        for node in graph.nodes:
            if inside:
                node.meta[KEY] = state["regions"]
            inside = inside or node is start

    class _Direct:  # stands in for the reentrant CheckpointFunction
        @staticmethod
        def apply(function: Any, _preserve_rng_state: bool, *args: Any) -> Any:
            with region():
                return function(*args)

    def direct(*_args: Any, **_kwargs: Any) -> Iterator[None]:  # the non-reentrant path's generator
        with region():
            yield

    ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = _Direct, direct  # type: ignore[misc]
    try:
        yield state
    finally:
        ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = real_fn, real_gen  # type: ignore[misc]


class Recompute(nn.Module):
    """Runs one region of the graph under non-reentrant ``torch.utils.checkpoint``.

    Args:
        inner: The region's GraphModule.
    """

    def __init__(self, inner: torch.fx.GraphModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        """The region's outputs; its activations are recomputed in backward, not saved."""
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True)


def _partitions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Compute node -> partition: consecutive nodes inside one region's span, or between spans."""
    nodes = list(graph.nodes)
    spans: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        k = node.meta.get(KEY)
        if k is not None and node.op in ("call_function", "call_method", "call_module"):
            span = spans.setdefault(k, [i, i])
            span[1] = i
    owner: dict[int, int] = {}
    for k, (lo, hi) in spans.items():
        for i in range(lo, hi + 1):
            owner.setdefault(i, k)  # overlapping spans (reordered by a pass): the earlier region keeps it
    index = {n: i for i, n in enumerate(nodes)}
    for k, (lo, _) in sorted(spans.items(), key=lambda item: item[1][0]):
        # untagged nodes right before a region that only it uses (a cast amplite put on the region's input) join
        # it: the region then saves the value before the cast, not a second, often FP32, copy of it
        i = lo - 1
        while i >= 0 and i not in owner and nodes[i].meta.get(KEY) is None:
            node = nodes[i]
            if node.op in ("call_function", "call_method", "call_module"):
                if not node.users or any(owner.get(index[u]) != k for u in node.users):
                    break
                owner[i] = k
            i -= 1
    parts: dict[torch.fx.Node, int] = {}
    part, last = -1, object()
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        here = owner.get(i)
        if here != last or part < 0:
            part, last = part + 1, here
        parts[node] = part
    return parts


def checkpoint_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with every tagged region recomputed in backward; ``(gm, 0)`` when nothing is tagged.

    Returns:
        The module to run for training and how many regions it recomputes.
    """
    parts = _partitions(gm.graph)
    regions = {p for node, p in parts.items() if node.meta.get(KEY) is not None}
    if not regions:
        return gm, 0
    split = split_module(gm, gm, lambda node: parts[node], keep_original_order=True, keep_original_node_name=True)
    split.graph._codegen = copy.deepcopy(gm.graph._codegen)  # export's calling convention (pytree in and out)
    split.recompile()
    count = 0
    for name, sub in list(split.named_children()):
        index = int(name.removeprefix("submod_")) if name.startswith("submod_") else None
        if index in regions:
            setattr(split, name, Recompute(sub))
            count += 1
    return split, count
