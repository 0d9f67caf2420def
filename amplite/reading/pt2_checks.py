"""Checks of what a .pt2's entries hold against what its program says they are, and bounds on their size.

The archive's own byte check (``archive.py``) makes sure a tensor's reachable bytes are in its file; these
checks add what only the loaded objects show: a view must not make more elements than its storage holds (a
stride-0 view turns 12 bytes into GBs once anything copies it), every weight and constant must have the shape and
dtype the graph's placeholder for it declares (the graph, not the payload, is what torch compiled against), and
example inputs are bounded the same way. :func:`build_expressions` turns the program's size expressions into
sympy objects by amplite's grammar, so torch's deserializer has no text left to evaluate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.errors import LoadError
from amplite.reading.program_strings import is_parameter_name
from amplite.reading.sym_expr import SymExprError, parse_sym_expr

#: A view may make more elements than its storage holds (``arange(n).expand(1, -1)``) up to this many bytes.
EXPANDED_BYTES = 16 << 20
_FIX = "re-save the model with torch.export.save (and copy the file again)"


def check_expansion(path: Path, what: str, tensor: torch.Tensor) -> None:
    """Refuse a view that makes more than :data:`EXPANDED_BYTES` beyond what its storage holds.

    Raises:
        LoadError: ``tensor`` is a broadcast view of a smaller storage, too large to materialise safely.
    """
    stored = tensor.untyped_storage().nbytes()
    made = tensor.numel() * tensor.element_size()
    if made > max(stored, EXPANDED_BYTES):
        raise LoadError(
            f"{str(path)!r}: {what} is a view of shape {list(tensor.shape)} ({made:,} bytes) over {stored:,} stored "
            "bytes (a stride-0 or overlapping view)",
            _FIX,
        )


def check_example_inputs(path: Path, sample: Any) -> None:
    """Bound every tensor of the example inputs (they are copied and run)."""
    leaves: list[Any] = []
    torch.utils._pytree.tree_map(leaves.append, sample)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            check_expansion(path, f"example input {i}", leaf)


def check_payload_metadata(
    path: Path, program: dict[str, Any], weights: dict[str, Any], constants: dict[str, Any]
) -> None:
    """Every weight, buffer and constant has the shape and dtype of the graph's placeholder for it.

    Compared on the JSON, before any tensor is built: ``program`` is ``models/model.json``, ``weights`` and
    ``constants`` the payload configs (name -> ``{"tensor_meta": ...}``).

    Raises:
        LoadError: Naming the tensor and both shapes (or dtypes).
    """
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    graph = program.get("graph_module", {}) or {}
    values = (graph.get("graph") or {}).get("tensor_values") or {}
    keys = {"parameter": ("parameter_name", weights), "buffer": ("buffer_name", weights),
            "tensor_constant": ("tensor_constant_name", constants)}  # fmt: skip
    for spec in (graph.get("signature") or {}).get("input_specs") or []:
        if not isinstance(spec, dict) or len(spec) != 1:
            continue  # torch's schema check reports it
        ((kind, body),) = spec.items()
        if kind not in keys or not isinstance(body, dict):
            continue
        field, table = keys[kind]
        name, arg = body.get(field), (body.get("arg") or {}).get("name")
        stored = (table.get(name) or {}).get("tensor_meta") if isinstance(table.get(name), dict) else None
        declared = values.get(arg)
        if not isinstance(stored, dict) or not isinstance(declared, dict):
            continue
        got, want = _static_sizes(stored.get("sizes")), _static_sizes(declared.get("sizes"))
        if got is None or want is None:
            continue  # a symbolic size: the range constraints bound it
        if got != want or stored.get("dtype") != declared.get("dtype"):
            raise LoadError(
                f"{str(path)!r}: {kind.replace('_', ' ')} {name!r} is stored as "
                f"{_SERIALIZE_TO_TORCH_DTYPE.get(stored.get('dtype'))} {got} but the program uses it as "
                f"{_SERIALIZE_TO_TORCH_DTYPE.get(declared.get('dtype'))} {want}",
                _FIX,
            )


def _static_sizes(sizes: Any) -> list[int] | None:
    if not isinstance(sizes, list) or not all(isinstance(s, dict) and type(s.get("as_int")) is int for s in sizes):
        return None
    return [s["as_int"] for s in sizes]


def build_expressions(path: Path, serialized: Any) -> None:
    """Replace every size expression's text by the sympy object amplite's grammar builds (torch's sympify then
    returns it unchanged: no text of the file is evaluated)."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    symbols: dict[str, Any] = {}
    seen: set[int] = set()
    stack = [serialized]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif dataclasses.is_dataclass(value) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, schema.SymExpr) and isinstance(value.expr_str, str):
                try:
                    value.expr_str = parse_sym_expr(value.expr_str, symbols)
                except SymExprError as exc:
                    raise LoadError(
                        f"{str(path)!r}: the size expression {value.expr_str[:60]!r} {exc}",
                        "re-save the model with torch.export.save (amplite never evaluates a file's text)",
                    ) from None
                continue
            if isinstance(value, _Union):  # one field set; reading another raises
                stack.append(value.value)
            else:
                stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))


def check_call_graph(path: Path, program: ExportedProgram) -> None:
    """The program's calling convention is what ``torch.export`` writes, before FX generates ``forward`` from it.

    ``program.module()`` writes the signature's argument names and the keyword names of its input spec into
    Python source that it compiles and runs; a wrong type or name there fails (or worse) inside torch. The
    strings were checked on the JSON (``program_strings``); this checks the deserialized structure.

    Raises:
        LoadError: A call graph without the root entry, or a root signature of the wrong kind.
    """
    from torch.utils._pytree import TreeSpec

    graph = program.module_call_graph
    if not isinstance(graph, list) or not graph or getattr(graph[0], "fqn", None) != "":
        raise LoadError(f"{str(path)!r}: the module call graph has no root entry (fqn '')", _FIX)
    for entry in graph:
        if not isinstance(getattr(entry, "fqn", None), str):
            raise LoadError(f"{str(path)!r}: a module call graph entry has a name that is not a string", _FIX)
    sig = graph[0].signature
    if sig is None or not isinstance(sig.in_spec, TreeSpec) or not isinstance(sig.out_spec, TreeSpec):
        raise LoadError(f"{str(path)!r}: the root signature has no input and output specs", _FIX)
    names = sig.forward_arg_names
    if names is not None and not (
        isinstance(names, list)
        and all(is_parameter_name(n) for n in names)
        and len(set(names)) == len(names)
    ):
        raise LoadError(f"{str(path)!r}: the root signature's argument names are not distinct identifiers", _FIX)


def check_symbols(path: Path, program: ExportedProgram) -> None:
    """Every symbolic size the graph uses has a range constraint: torch's shape reasoning asserts on a symbol
    without one ("vr must not be None") the first time a pass asks about it.

    Raises:
        LoadError: Naming the symbol.
    """
    known = {str(s) for s in program.range_constraints}
    for node in program.graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (list, tuple)) else [vals]:
            sizes = [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else [val]
            for size in sizes:
                expr = getattr(getattr(size, "node", None), "expr", None)
                free = {str(s) for s in getattr(expr, "free_symbols", ())}
                if free - known:
                    raise LoadError(f"{str(path)!r}: node {node.name!r} has a size with symbol "
                                    f"{sorted(free - known)[0]!r}, which has no range constraint", _FIX)  # fmt: skip
