"""Pre-ONNX rewrite: remove what makes ``torch.onnx``'s decomposition fail, on a copy of the program.

Guarantees afterwards (the converted program itself is untouched; the copy computes the same values):

* every ``aten.view`` is an ``aten.reshape`` (``views_to_reshape``), every ``contiguous`` a real copy
  (``clone``), and a reshape whose input comes straight from a transpose, permute or SDPA reads a
  contiguous copy of it (``contiguous_before_reshape``). The exporter
  decomposes in two re-traces, and a decomposed ``scaled_dot_product_attention`` lays its result out
  differently from the fused one; a view recorded for the old layout then fails ("Cannot view a tensor
  with shape …", T5-small). ONNX has no strides: the copy is an Identity the optimiser removes;
* every size-0 tensor constant is created in the graph (``empty_constants_materialised``) instead of
  being a lifted constant. The decomposition finds lifted constants again by their storage, and every
  size-0 tensor has the same (null) storage, so all but the first are lifted under new names the
  constants table does not hold ("Constant tensor lifted_tensor_8 is not in the constants dictionary":
  transformers' ``DynamicCache`` starts each layer from ``torch.tensor([])``), and every
  ``lift_fresh_copy`` of one is a plain ``clone`` (re-tracing a ``lift_fresh_copy`` lifts its input as a
  new constant, with the same result).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind
from torch.utils import _pytree as pytree

aten = torch.ops.aten
_RESHAPES = frozenset((aten.view.default, aten.reshape.default))
#: Producers whose output layout (strides) the exporter's decompositions may change.
_RELAYOUT = frozenset((aten.transpose.int, aten.permute.default, aten.t.default,
                       aten.scaled_dot_product_attention.default))  # fmt: skip


def onnx_ready(program: ExportedProgram) -> tuple[ExportedProgram, dict[str, int]]:
    """A copy of ``program`` that ``torch.onnx.export`` can decompose, and what was rewritten.

    Returns:
        The program to export (``program`` itself when nothing needed rewriting) and the counters.
    """
    views = [n for n in program.graph.nodes if n.op == "call_function" and n.target in _RESHAPES]
    empty = [
        s for s in program.graph_signature.input_specs
        if s.kind == InputKind.CONSTANT_TENSOR and isinstance(program.constants.get(s.target), torch.Tensor)
        and program.constants[s.target].numel() == 0
    ]  # fmt: skip
    counters = {
        "views_to_reshape": sum(1 for n in views if n.target is aten.view.default),
        "empty_constants_materialised": len(empty),
        "contiguous_before_reshape": 0,
        "empty_cat_inputs_dropped": 0,
        "cache_constants_preregistered": 0,
    }
    fresh = [n for n in program.graph.nodes if n.op == "call_function" and n.target is aten.lift_fresh_copy.default]
    custom = _custom_pytree(program)
    counters["cache_constants_preregistered"] = int(custom)
    if not views and not empty and not fresh and not custom:
        return program, counters
    gm = copy.deepcopy(program.graph_module)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.contiguous.default:
            node.target, node.kwargs = aten.clone.default, {"memory_format": torch.contiguous_format}
        if node.op == "call_function" and node.target is aten.lift_fresh_copy.default:
            node.target = aten.clone.default  # the same copy; re-tracing would lift its input again
        if node.op == "call_function" and node.target in _RESHAPES:
            node.target = aten.reshape.default
            counters["contiguous_before_reshape"] += _contiguous_input(graph, node)
    names = {s.arg.name for s in empty}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    constants = dict(program.constants)
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        spec = next(s for s in empty if s.arg.name == node.name)
        value = constants.pop(spec.target)
        with graph.inserting_before(first_op):
            made = graph.call_function(aten.empty.memory_format, (list(value.shape),),
                                       {"dtype": value.dtype, "device": value.device})  # fmt: skip
        made.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        node.replace_all_uses_with(made)
        graph.erase_node(node)
    counters["empty_cat_inputs_dropped"] = _drop_empty_cat_inputs(graph)
    graph.eliminate_dead_code()
    gm.recompile()
    signature = ExportGraphSignature(
        input_specs=[dataclasses.replace(s) for s in program.graph_signature.input_specs if s.arg.name not in names],
        output_specs=list(program.graph_signature.output_specs),
    )
    ready = _program(program, gm, signature, constants)
    if custom:
        _preregister_cache_constants(ready)
    return ready, counters


def _custom_pytree(program: ExportedProgram) -> bool:
    """Whether the program's inputs or outputs hold a class of their own (e.g. a ``DynamicCache``)."""
    sig = program.call_spec
    return any(spec is not None and _has_custom(spec) for spec in (sig.in_spec, sig.out_spec))


def _has_custom(spec: pytree.TreeSpec) -> bool:
    return _custom_leaves(spec) > 0


def _custom_leaves(spec: pytree.TreeSpec | None) -> int:
    """How many leaves sit under classes of their own in ``spec``."""
    if spec is None:
        return 0
    if spec.type not in (tuple, list, dict, type(None)) and spec.num_children:
        return spec.num_leaves
    return sum(_custom_leaves(spec.child(i)) for i in range(spec.num_children))


def _preregister_cache_constants(program: ExportedProgram) -> int:
    """Register the constants a cache input's constructor makes when the exporter re-traces the program.

    Re-tracing rebuilds the cache object from the flat inputs, and transformers' ``DynamicCache`` layers
    start from ``torch.tensor([])``: torch lifts each as ``lifted_tensor_N`` but keeps the old constants
    table (torch 2.11-2.13). Those tensors are empty float32 and only ever concatenated with: registering
    empty tensors under the names torch will use makes the table complete.
    """
    taken = sum(1 for s in program.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR)
    count = 2 * _custom_leaves(program.call_spec.in_spec)  # a margin: extra entries are never read
    for i in range(taken, taken + count):
        program._constants.setdefault(f"lifted_tensor_{i}", torch.tensor([]))
    return count


def _drop_empty_cat_inputs(graph: torch.fx.Graph) -> int:
    """``cat`` skips 1-D size-0 inputs (its legacy rule): drop them, so the empty tensors die unused."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.detach_.default:
            node.replace_all_uses_with(node.args[0])  # no autograd in an exported inference graph
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.cat.default:
            keep = [a for a in node.args[0] if not _empty_1d(a)]
            if keep and len(keep) < len(node.args[0]):
                dropped += len(node.args[0]) - len(keep)
                node.args = (keep, *node.args[1:])
    return dropped


def _empty_1d(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == 0


def _contiguous_input(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    """Give a reshape a contiguous input when its input's layout came from a transpose, permute or SDPA."""
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or src.target not in _RELAYOUT:
        return 0
    with graph.inserting_before(node):
        made = graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
    val = src.meta.get("val")
    if isinstance(val, torch.Tensor):
        made.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    made.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_input_with(src, made)
    return 1


def _program(
    program: ExportedProgram, gm: torch.fx.GraphModule, signature: ExportGraphSignature, constants: dict[str, Any]
) -> ExportedProgram:
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )
