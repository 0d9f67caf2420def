"""Build the converted ExportedProgram from the rewritten graph directly, without tracing it again.

The passes rewrite ``ep.module()``: an *unlifted* GraphModule whose weights are attributes read by
``get_attr`` nodes and whose every node carries the FakeTensor ``meta['val']`` the passes keep up to date
(:class:`~amplite.converter.dtype_check.CheckDtypes` has just checked its dtypes by FakeTensor propagation).
:func:`lift` turns it back into the program form torch.export produces — the inverse of torch's
``_unlift_exported_program_lifted_states``:

- every parameter and buffer of the module (``named_parameters()``/``named_buffers()`` order, tied tensors
  once, under their first name) and every tensor constant a ``get_attr`` reads becomes a placeholder
  (``p_``/``b_``/``c_`` + its path, torch's own naming) ahead of the user inputs, with an
  :class:`~torch.export.graph_signature.InputSpec` of kind PARAMETER, BUFFER (persistent or not) or
  CONSTANT_TENSOR and the module's *new* tensors (the low-precision copies) in ``state_dict``/``constants``;
- the user inputs and outputs keep the original program's specs, renamed to the rewritten graph's nodes;
  the module call graph keeps the original pytree specs; range constraints, verifiers and the fake mode
  (shape environment, symbolic dims) are the original program's, so guards are derived as export derives
  them (``ExportedProgram`` recomputes its ``_guards_code``; ``.module()`` builds ``_guards_fn`` from the
  placeholders' values and the example inputs, lowered for low-precision I/O).

What lifting does not handle raises :class:`NotDirect` with the reason, and the pipeline re-exports
instead: buffer or input mutations (``copy_`` into state), ``get_attr`` of non-tensors (submodules of
control-flow ops, script objects), module call graphs with more than the root signature, a node without
``meta['val']``, or anything the program's verifier rejects (:func:`prove`).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
import torch.fx
from torch._export.utils import placeholder_prefixes
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec
from torch.utils import _pytree as pytree

_MUTATIONS = {torch.ops.aten.copy_.default}


class NotDirect(Exception):
    """The rewritten graph cannot be lifted into a program directly; the message says why."""


@dataclasses.dataclass
class _State:
    """One lifted tensor: its input kind, attribute path, value and whether it is saved with the weights."""

    kind: InputKind
    target: str
    value: torch.Tensor
    persistent: bool | None = None


def _states(gm: torch.fx.GraphModule) -> list[_State]:
    """Parameters, buffers (tied names each), then the constants ``get_attr`` reads, as torch.export lifts them."""
    found: list[_State] = [_State(InputKind.PARAMETER, n, p) for n, p in gm.named_parameters(remove_duplicate=False)]
    non_persistent = {
        f"{path}.{b}" if path else b
        for path, module in gm.named_modules()
        for b in getattr(module, "_non_persistent_buffers_set", ())
    }
    for name, buf in gm.named_buffers(remove_duplicate=False):
        found.append(_State(InputKind.BUFFER, name, buf, persistent=name not in non_persistent))
    seen = {id(s.value) for s in found}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(str(node.target))(gm)
        if not isinstance(value, torch.Tensor):
            raise NotDirect(f"get_attr {node.target} reads a {type(value).__name__}, not a tensor")
        if id(value) not in seen:
            seen.add(id(value))
            found.append(_State(InputKind.CONSTANT_TENSOR, str(node.target), value))
    return found


def _fake(mode: Any, node: torch.fx.Node | None, value: torch.Tensor) -> Any:
    """The placeholder's fake value: the get_attr's when it describes ``value``, else a fresh one."""
    val = node.meta.get("val") if node is not None else None
    same = isinstance(val, torch.Tensor) and val.dtype == value.dtype and val.shape == value.shape
    if same:
        return val
    return mode.from_tensor(value, static_shapes=True)


def _fake_mode(graph: torch.fx.Graph) -> Any:
    for node in graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    raise NotDirect("no node carries a FakeTensor value")


def _lift_states(
    graph: torch.fx.Graph, gm: torch.fx.GraphModule
) -> tuple[list[InputSpec], dict[str, torch.Tensor], dict[str, Any]]:
    """Turn ``gm``'s weights and read constants into placeholders ahead of the user inputs of ``graph``.

    Returns:
        Their input specs, in order, the saved tensors (``state_dict``) and the rest (``constants``).
    """
    mode = _fake_mode(graph)
    states = _states(gm)
    readers: dict[int, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="get_attr"):
        readers.setdefault(id(operator.attrgetter(str(node.target))(gm)), []).append(node)
    first = next(iter(graph.nodes))
    input_specs: list[InputSpec] = []
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    lifted: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = []
    last = {id(s.value): s for s in states}  # tied tensors: export's readers use the last name's placeholder
    with graph.inserting_before(first):
        for s in states:
            nodes = readers.get(id(s.value), []) if last[id(s.value)] is s else []
            name = placeholder_prefixes[s.kind] + re.sub(r"[^a-zA-Z0-9]", "_", s.target).lower()
            ph = graph.placeholder(name)
            ph.meta["val"] = _fake(mode, nodes[0] if nodes else None, s.value)
            lifted.append((ph, nodes))
            arg = torch.export.graph_signature.TensorArgument(name=ph.name)
            input_specs.append(InputSpec(s.kind, arg, s.target, s.persistent))
            saved = s.kind is InputKind.PARAMETER or (s.kind is InputKind.BUFFER and s.persistent)
            (state_dict if saved else constants)[s.target] = s.value
    for ph, nodes in lifted:  # after all placeholders exist: ``first`` may be one of these get_attrs
        for n in nodes:
            n.replace_all_uses_with(ph)
            graph.erase_node(n)
    return input_specs, state_dict, constants


def lift(original: ExportedProgram, gm: torch.fx.GraphModule, example_inputs: Any) -> ExportedProgram:
    """The ExportedProgram of the rewritten unlifted module ``gm`` of ``original``.

    Args:
        original: The FP32 program ``gm`` came from (``original.module()`` rewritten by the passes).
        gm: The rewritten module; not changed (its graph is copied, its tensors shared).
        example_inputs: ``(args, kwargs)`` the program keeps as its example (lowered for low-precision I/O).

    Raises:
        NotDirect: What prevents the direct build (the caller re-exports).
    """
    old = original.graph_signature
    if any(s.kind is not OutputKind.USER_OUTPUT for s in old.output_specs):
        raise NotDirect("the program mutates buffers or inputs")
    if any(s.kind not in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
           for s in old.input_specs):  # fmt: skip
        raise NotDirect("the program lifts custom objects or effect tokens")
    if any(e.signature is not None for e in original.module_call_graph[1:]):
        raise NotDirect("the program preserves submodule call signatures")
    graph = torch.fx.Graph()
    result = graph.graph_copy(gm.graph, {})  # nodes and (shallow-copied) meta, not the output node
    graph.output(result).meta.update(gm.graph.output_node().meta)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _MUTATIONS and node.args[0].op in ("get_attr", "placeholder"):
            raise NotDirect(f"node {node.name} writes into {node.args[0].target} in place")
    users = [n for n in graph.nodes if n.op == "placeholder"]
    input_specs, state_dict, constants = _lift_states(graph, gm)
    old_users = [s for s in old.input_specs if s.kind is InputKind.USER_INPUT]
    if len(old_users) != len(users):
        raise NotDirect(f"{len(users)} user inputs in the rewritten graph, {len(old_users)} in the program")
    pairs = zip(old_users, users, strict=True)
    input_specs += [InputSpec(InputKind.USER_INPUT, _renamed(s.arg, n), None) for s, n in pairs]
    output = graph.output_node()
    flat = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    if len(flat) != len(old.output_specs):
        raise NotDirect(f"{len(flat)} outputs in the rewritten graph, {len(old.output_specs)} in the program")
    outs = zip(old.output_specs, flat, strict=True)
    output_specs = [OutputSpec(OutputKind.USER_OUTPUT, _renamed(s.arg, v), None) for s, v in outs]
    signature = ExportGraphSignature(input_specs, output_specs)
    entry = original.module_call_graph[0]
    sig = entry.signature
    if sig is not None:
        sig = ModuleCallSignature(
            inputs=[s.arg for s in input_specs if s.kind is InputKind.USER_INPUT] if sig.inputs else [],
            outputs=[s.arg for s in output_specs] if sig.outputs else [],
            in_spec=sig.in_spec, out_spec=sig.out_spec, forward_arg_names=sig.forward_arg_names,
        )  # fmt: skip
    root = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    root.meta.update(original.graph_module.meta)
    try:
        program = ExportedProgram(
            root, graph, signature, state_dict, original.range_constraints, [ModuleCallEntry(entry.fqn, sig),
            *original.module_call_graph[1:]],
            example_inputs, constants, verifiers=list(original.verifiers),
        )  # fmt: skip
    except Exception as exc:  # the verifier (or the constructor's own checks) rejected the lifted program
        raise NotDirect(f"the program's verifier rejects it: {type(exc).__name__}: {_first_line(exc)}") from exc
    # The constructor derives guards from the shape environment, which amplite's own FakeTensor runs
    # (calibration shapes, check_dtypes) may have added to; the guards of the user's code are the trace's.
    program._guards_code = list(original._guards_code)
    return program


def _renamed(arg: Any, value: Any) -> Any:
    """``arg`` (an ArgumentSpec of the original program) naming ``value``'s node instead."""
    if isinstance(value, torch.fx.Node) and hasattr(arg, "name") and arg.name:
        return dataclasses.replace(arg, name=value.name)
    return arg


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def prove(program: ExportedProgram, gm: torch.fx.GraphModule, example_inputs: Any) -> None:
    """Cheap checks that the directly built program is what re-export would give (the verifier ran already).

    Every node except the output has ``meta['val']``; each lifted placeholder describes its tensor (dtype,
    shape); each user placeholder has the dtype and rank of its example input; the graph computes the same
    nodes as ``gm`` (same count of computing nodes).

    Raises:
        NotDirect: The first check that fails.
    """
    missing = [n.name for n in program.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing:
        raise NotDirect(f"node {missing[0]} has no meta['val'] ({len(missing)} nodes)")
    values = {n.name: n.meta["val"] for n in program.graph.find_nodes(op="placeholder")}
    stored = {**program.state_dict, **program.constants}
    for spec in program.graph_signature.input_specs:
        val = values[spec.arg.name]
        if spec.kind is InputKind.USER_INPUT:
            continue
        tensor = stored[spec.target]
        if val.dtype != tensor.dtype or tuple(val.shape) != tuple(tensor.shape):
            raise NotDirect(f"placeholder {spec.arg.name} does not describe {spec.target}")
    user = [values[s.arg.name] for s in program.graph_signature.input_specs if s.kind is InputKind.USER_INPUT]
    if example_inputs is not None:
        flat = pytree.tree_leaves(example_inputs)
        if len(flat) == len(user):
            for val, x in zip(user, flat, strict=True):
                if isinstance(x, torch.Tensor) != isinstance(val, torch.Tensor) or (
                    isinstance(x, torch.Tensor) and (x.dtype != val.dtype or x.dim() != val.dim())
                ):
                    raise NotDirect("a user input placeholder does not describe its example input")
    mode = _fake_mode(program.graph)
    env = getattr(mode, "shape_env", None)
    pinned = [s for s in program.range_constraints if env is not None and s in env.replacements]
    if pinned:  # the shared shape environment no longer treats a dynamic dim as free: saved shapes would not be
        raise NotDirect(f"dynamic dim {pinned[0]} was specialized after export (to {env.replacements[pinned[0]]})")
    computing = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    if computing != sum(1 for n in program.graph.nodes if n.op == "call_function"):
        raise NotDirect("the lifted graph lost or gained computing nodes")
