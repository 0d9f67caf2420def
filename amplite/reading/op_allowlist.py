"""The operators a loaded .pt2 may run: those ``torch.export`` of a model produces, and nothing with effects.

torch's deserializer resolves any ``torch.ops`` name, so a hand-made file can call ``aten::from_file(...,
shared=True)`` and write into it with an in-place op. amplite accepts an operator only if it is one of:

- an ATen operator that export can emit: tagged ``core``, in torch's decomposition table (what export's
  decompositions produce and consume), CompositeImplicitAutograd (what training IR keeps, ``aten.linear``),
  or one of :data:`EXPORT_OPS` (size queries, asserts, copies export writes itself), and not in
  :data:`EFFECTFUL` (files, printing, storage swaps);
- amplite's own (``amplite::``);
- a higher-order operator of :data:`HIGHER_ORDER` (control flow, autocast/grad regions, functionalization);
- a custom operator registered by a module the user named with ``--import`` (``import_modules``).

A second rule holds for the graph, subgraphs included: an operator that writes to an argument (``Tensor(a!)``)
may write to intermediates and buffers (a model's state), never to parameters, constants or the user's inputs,
directly or through a view.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

#: ATen operators export writes that no table lists (size queries, runtime asserts, its own copies).
EXPORT_OPS = frozenset(
    {
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "sym_constrain_range",
        "sym_constrain_range_for_size", "_assert_scalar", "_assert_async", "_assert_tensor_metadata",
        "_functional_assert_async", "_functional_assert_scalar", "_functional_sym_constrain_range",
        "_functional_sym_constrain_range_for_size", "_local_scalar_dense", "lift_fresh_copy", "copy_", "alias",
        "detach_", "_make_dep_token", "_to_copy", "_unsafe_view", "clone",
    }
)  # fmt: skip
#: ATen operators with effects beyond their tensors' values, refused even where a table lists them.
EFFECTFUL = frozenset(
    {
        "from_file", "_print", "set_", "_set_storage_", "save", "_nested_tensor_from_mask",
        "_use_cudnn_rnn_flatten_weight", "record_stream", "_cufft_clear_plan_cache", "_cufft_set_plan_cache_max_size",
        "_propagate_xla_data", "share_memory_", "_share_memory_", "_file_name_", "_new_shared_filename",
    }
)  # fmt: skip
#: Higher-order operators export of a model produces.
HIGHER_ORDER = frozenset(
    {
        "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan",
        "wrap_with_set_grad_enabled", "wrap_with_autocast", "auto_functionalized", "auto_functionalized_v2",
        "with_effects", "invoke_subgraph", "out_dtype", "flex_attention", "flex_attention_backward",
        "hints_wrapper", "tag_activation_checkpoint", "wrap_activation_checkpoint",
    }
)  # fmt: skip
_OWN = ("amplite",)


def refusal(op: Any, custom: frozenset[str] = frozenset()) -> str | None:
    """Why ``op`` may not run in a loaded program, or None when it may.

    Args:
        op: A node target (``OpOverload``, ``HigherOrderOperator``, or a Python function of torch's symbolic
            arithmetic, which the name check admitted).
        custom: Qualified names (``ns::op``) registered by the modules the user imported.
    """
    if isinstance(op, torch._ops.HigherOrderOperator):
        if op.name() in HIGHER_ORDER:
            return None
        return f"the higher-order operator {op.name()!r} is not one export writes"
    if not isinstance(op, torch._ops.OpOverload):
        return None  # torch's symbolic arithmetic (operator.add, sym_max, ...): resolved by name, checked there
    namespace = op.namespace
    name = op._schema.name  # "aten::add_"
    base = name.split("::", 1)[1]
    if namespace in _OWN:
        return None
    if namespace != "aten":
        if name in custom:
            return None
        return f"{name} is not an ATen operator nor one registered by a module named with --import"
    if base in EFFECTFUL:
        return f"{name} acts outside its tensors (files, printing, storage); no traced model calls it"
    if _exportable(op) or base in EXPORT_OPS:
        return None
    return f"{name}.{op._overloadname} is not an operator torch.export of a model produces"


def _exportable(op: torch._ops.OpOverload) -> bool:
    from torch._decomp import decomposition_table

    if torch.Tag.core in op.tags or op in decomposition_table:
        return True
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return True
    return _functional_twin_exportable(op)


@functools.cache
def _functional_twin_exportable(op: torch._ops.OpOverload) -> bool:
    """``add_`` when ``add`` is exportable: training IR keeps a model's in-place ops (the write rule checks them)."""
    from torch._decomp import decomposition_table

    base = op._schema.name.split("::", 1)[1]
    if not base.endswith("_") or base.startswith("_"):
        return False
    packet = getattr(torch.ops.aten, base[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    return isinstance(twin, torch._ops.OpOverload) and (torch.Tag.core in twin.tags or twin in decomposition_table)


def registered_ops() -> frozenset[str]:
    """Every operator name the dispatcher knows now (``ns::op``), for telling what an ``--import`` added."""
    return frozenset(name.split(".", 1)[0] for name in torch._C._dispatch_get_all_op_names())


def check_program_ops(program: ExportedProgram, custom: frozenset[str] = frozenset()) -> str | None:
    """Why ``program`` may not run (its first refused operator or write), or None when every node is allowed."""
    sig = program.graph_signature
    protected = {
        spec.arg.name: f"the {spec.kind.name.lower().replace('_', ' ')} {spec.target or spec.arg.name!r}"
        for spec in sig.input_specs
        if spec.kind != InputKind.BUFFER and hasattr(spec.arg, "name")
    }
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT and spec.arg.name in sig.user_inputs_to_mutate.values():
            protected.pop(spec.arg.name, None)  # a mutation the signature declares
    for gm in _graph_modules(program.graph_module):
        roots: dict[torch.fx.Node, torch.fx.Node] = {}
        top = gm is program.graph_module
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            for op in _operators(node):
                why = refusal(op, custom)
                if why is not None:
                    return f"node {node.name!r} calls {why}"
            why = _write_refusal(node, roots, protected if top else {})
            if why is not None:
                return why
    return None


def _graph_modules(root: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    for module in root.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield module


def _operators(node: torch.fx.Node) -> Iterable[Any]:
    """The node's target and any operator passed as an argument (``with_effects``, ``auto_functionalized``)."""
    yield node.target
    for arg in torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: a):
        if isinstance(arg, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            yield arg


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    torch.fx.node.map_aggregate(args, out.append)
    return out


def _write_refusal(
    node: torch.fx.Node, roots: dict[torch.fx.Node, torch.fx.Node], protected: dict[str, str]
) -> str | None:
    """Track which placeholder each view aliases; refuse a write whose target aliases a protected input."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    schema = op._schema
    bound = _bind(node, schema)
    for arg, value in bound:
        info = arg.alias_info
        if info is None or not isinstance(value, torch.fx.Node):
            continue
        root = roots.get(value, value)
        if info.is_write:
            if root.op == "get_attr":
                return f"node {node.name!r} ({schema.name}) writes to the constant {root.target!r}"
            if root.op == "placeholder" and root.name in protected:
                return f"node {node.name!r} ({schema.name}) writes in place to {protected[root.name]}"
        elif any(ret.alias_info is not None and set(ret.alias_info.before_set) & set(info.before_set)
                 for ret in schema.returns):  # fmt: skip
            roots[node] = root  # a view of its argument
    if any(ret.alias_info is not None and ret.alias_info.is_write for ret in schema.returns):
        for arg, value in bound:
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                roots[node] = roots.get(value, value)
                break
    return None


def _bind(node: torch.fx.Node, schema: Any) -> list[tuple[Any, Any]]:
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    for arg, value in list(out):  # a write through a list of tensors (Tensor(a!)[]): every element counts
        if isinstance(value, (list, tuple)):
            out.extend((arg, v) for v in _flat(value) if isinstance(v, torch.fx.Node))
    return out
