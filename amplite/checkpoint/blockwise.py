"""Verification for models that do not fit: run both programs node by node, loading each weight just
before its first use and dropping it after its last, and compare every decoder block's output.

The FP32 program reads the source shards; the converted one reads the converted files that were written
(what the user gets). Weight loads are moved next to their first reader, so at most about one block's
weights are alive at once; the bound is computed before anything runs (``max_memory``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from amplite.checkpoint.write import cpu_stand_ins
from amplite.errors import ConfigError
from amplite.passes.graph_utils import cast_dtype, module_path
from amplite.verify.compare import Tolerance, compare

_BLOCK = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)(?:\.|$)")
Loader = Callable[[str], torch.Tensor]
#: Called with a node and its argument values before it runs; returns the arguments to run it on.
Hook = Callable[[torch.fx.Node, tuple[Any, ...]], tuple[Any, ...]]


def runnable_module(program: ExportedProgram) -> torch.fx.GraphModule:
    """``program.module()`` retargeted from meta to the CPU, weights left as stand-ins to be loaded lazily."""
    with cpu_stand_ins(program):
        gm = program.module()
    _sink_weight_loads(gm)
    return gm


def _sink_weight_loads(gm: torch.fx.GraphModule) -> None:
    """Move every ``get_attr`` to just before its first user (unlifting puts them all at the top)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.users:
            first = min(node.users, key=_order(gm))
            first.prepend(node)
    gm.graph.lint()
    gm.recompile()


def _order(gm: torch.fx.GraphModule) -> Callable[[torch.fx.Node], int]:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]


def peak_weight_bytes(gm: torch.fx.GraphModule, sizes: dict[str, int]) -> int:
    """Largest total size of weights alive at once when ``gm`` runs in order (each freed after its last use)."""
    order = _order(gm)
    last = {n: max((order(u) for u in n.users), default=order(n)) for n in gm.graph.nodes if n.op == "get_attr"}
    live, peak = 0, 0
    ends: dict[int, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr":
            live += sizes.get(str(node.target), 0)
            ends[last[node]] = ends.get(last[node], 0) + sizes.get(str(node.target), 0)
        peak = max(peak, live)
        live -= ends.pop(i, 0)
    return peak


def _sizes(program: ExportedProgram) -> dict[str, int]:
    tensors = [*program.state_dict.items(), *program.constants.items()]
    return {n: t.numel() * t.element_size() for n, t in tensors if isinstance(t, torch.Tensor)}


class _Streaming(torch.fx.Interpreter):
    """Runs a GraphModule, fetching weights through ``loader``; records each block's last output. ``hook`` may
    change a call's arguments (the FP8 read-back quantizes linear inputs with their scales)."""

    def __init__(self, gm: torch.fx.GraphModule, loader: Loader, hook: Hook | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.loader = loader
        self.hook = hook
        self._node: torch.fx.Node | None = None
        self.blocks: dict[str, torch.Tensor] = {}
        self._last = _block_outputs(gm)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        attr = self.fetch_attr(str(target))
        if isinstance(attr, torch.nn.Module):  # a higher-order op's sub-graph (submod_N, true_graph_0): no weight
            return attr
        return self.loader(str(target))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.hook is not None and self._node is not None:
            args = self.hook(self._node, tuple(args))
        return super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        out = super().run_node(n)
        block = self._last.get(n)
        if block is not None and isinstance(out, torch.Tensor):
            self.blocks[block] = out.detach().float()
        return out


def _block_outputs(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The last non-cast floating node of each decoder block, by block path."""
    last: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        match = _BLOCK.match(module_path(node) + ".")
        val = node.meta.get("val")
        if match and isinstance(val, torch.Tensor) and val.dtype.is_floating_point and cast_dtype(node) is None:
            last[match.group(1)] = node
    return {node: block for block, node in last.items()}


def flat_inputs(program: ExportedProgram, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> list[Any]:
    """``(args, kwargs)`` in the order of the program's placeholders (keyword inputs in the order traced).

    Raises:
        ConfigError: A keyword input the program was not traced with, or one it needs that is missing.
    """
    args, kwargs = inputs
    spec = program.call_spec.in_spec
    names = list(spec.child(1).context) if spec is not None and spec.num_children > 1 else []
    if set(kwargs) != set(names):
        raise ConfigError(f"verification inputs {sorted(kwargs)} differ from the traced inputs {names}",
                          "pass the same --input names for tracing and verification")  # fmt: skip
    return [*args, *(kwargs[n] for n in names)]


def verify_blockwise(
    reference: ExportedProgram,
    converted: ExportedProgram,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    load_reference: Loader,
    load_converted: Loader,
    tolerance: Tolerance,
    *,
    max_memory: float | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    converted_hook: Hook | None = None,
) -> dict[str, Any]:
    """Run both programs streaming their weights and compare per block and at the outputs.

    Args:
        reference, converted: The FP32 and converted programs (meta weights).
        inputs: Real example inputs ``(args, kwargs)``.
        load_reference, load_converted: Weight name -> tensor, read from disk on demand.
        tolerance: Thresholds for the final outputs.
        max_memory: Refuse (ConfigError) when the weights alive at once would exceed this many bytes.
        progress: Called as ``("verifying", bytes of weights loaded, total)`` as both programs run.
        converted_hook: Changes the converted program's call arguments (FP8: quantized linear inputs).

    Returns:
        The report's ``verification`` section plus ``blocks`` (per-block SQNR and max abs error, accumulated:
        each program on its own activations) and ``peak_weight_bytes``.
    """
    ref_gm, conv_gm = runnable_module(reference), runnable_module(converted)
    peak = max(peak_weight_bytes(ref_gm, _sizes(reference)), peak_weight_bytes(conv_gm, _sizes(converted)))
    if max_memory is not None and peak > max_memory:
        raise ConfigError(
            f"block-wise verification needs {peak / 2**30:.2f} GiB of weights at once, over "
            f"--verify-max-memory {max_memory / 2**30:.2f} GiB",
            "raise --verify-max-memory, or skip verification with --no-verify",
        )
    flat = flat_inputs(reference, inputs)
    with torch.no_grad():
        total = sum(_sizes(reference).values()) + sum(_sizes(converted).values())
        done = [0]

        def counted(load: Loader) -> Loader:
            def wrapped(name: str) -> torch.Tensor:
                t = load(name)
                done[0] += t.numel() * t.element_size()
                if progress is not None:
                    progress("verifying", min(done[0], total), total)
                return t

            return wrapped

        ref_run = _Streaming(ref_gm, counted(load_reference))
        conv_run = _Streaming(conv_gm, counted(load_converted), converted_hook)
        ref_out = ref_run.run(*flat)
        conv_out = conv_run.run(*flat)
    metrics = compare(ref_out, conv_out, tolerance)
    blocks = []
    for name, ref in ref_run.blocks.items():
        got = conv_run.blocks.get(name)
        if got is None or got.shape != ref.shape:
            continue
        err = got - ref
        sqnr = 10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum().clamp_min(1e-30))
        blocks.append({"block": name, "sqnr_db": round(float(sqnr), 2), "max_abs": float(err.abs().max())})
    return {
        "passed": all(m.passed for m in metrics),
        "inputs": "the example inputs",
        "tolerance": {**vars(tolerance), "criteria": list(tolerance.criteria)},
        "outputs": [m.to_dict() for m in metrics],
        "blocks": blocks,
        "peak_weight_bytes": peak,
        "mode": "block-wise streaming (each weight loaded before its first use, freed after its last)",
    }
