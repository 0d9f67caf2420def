"""torch.export with errors a user can act on."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.export import Dim, ExportedProgram
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from amplite.describe import export_failure
from amplite.errors import ConfigError, ExportError

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
log = logging.getLogger("amplite")


DynamicDims = Mapping[str, Sequence[int]]

def dynamic_shapes_for(
    model: torch.nn.Module, args: tuple, kwargs: dict, *, batch: bool = False, dims: DynamicDims | None = None
) -> Any:
    """``dynamic_shapes`` for ``torch.export``: dim 0 of every tensor input when ``batch``, plus the named
    inputs' ``dims`` (each ``Dim.AUTO``; :func:`check_dynamic` then says if the model fixed one).

    Raises:
        ConfigError: ``dims`` names an input the model does not take, a non-tensor input or a missing dim.
    """
    dims = dict(dims or {})

    def spec(x: Any, extra: Sequence[int] = ()) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        chosen = {0} if batch else set()
        chosen |= {d % x.dim() for d in extra}
        return {d: Dim.AUTO for d in sorted(chosen)} or None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = None
    if bound is None:
        if dims:
            raise ConfigError("--dynamic-dim needs the model's input names", "use --dynamic-batch, or name the inputs")
        return tuple(pytree.tree_map(spec, list(args) + list(kwargs.values())))
    for name, wanted in dims.items():
        value = bound.get(name)
        if not isinstance(value, torch.Tensor):
            known = ", ".join(n for n, v in bound.items() if isinstance(v, torch.Tensor)) or "none"
            raise ConfigError(f"--dynamic-dim {name}: the model has no tensor input {name!r}",
                              f"name one of its tensor inputs: {known}")  # fmt: skip
        bad = [d for d in wanted if not -value.dim() <= d < value.dim()]
        if bad:
            raise ConfigError(f"--dynamic-dim {name}:{bad[0]}: input {name!r} has {value.dim()} dims",
                              f"give a dim in 0..{value.dim() - 1}")  # fmt: skip
    return {
        name: spec(value, dims[name]) if name in dims else pytree.tree_map(spec, value)
        for name, value in bound.items()
    }


def check_dynamic(program: ExportedProgram, dims: DynamicDims) -> None:
    """Raise if a dim the user asked to be dynamic came out static (the model fixes its size).

    Raises:
        ConfigError: Naming the input, the dim and the size the model fixed.
    """
    if not dims:
        return
    names = {}
    found = program.module_call_graph[0].signature if program.module_call_graph else None
    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    if found is not None and found.forward_arg_names and len(found.forward_arg_names) == len(user):
        names = dict(zip(found.forward_arg_names, user, strict=True))
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    for name, wanted in dims.items():
        val = values.get(names.get(name, name))
        if not isinstance(val, torch.Tensor):
            continue
        for d in wanted:
            size = val.shape[d % val.dim()]
            if is_concrete_int(size):  # a SymInt the model's code equated to a constant counts too
                raise ConfigError(f"--dynamic-dim {name}:{d}: the model fixes that dim to {size}",
                                  "drop that --dynamic-dim (or make the model independent of that size)")  # fmt: skip


def static_batch_inputs(program: ExportedProgram) -> list[str]:
    """User inputs whose dim 0 is static although a dynamic batch was asked for (the model fixes it)."""
    out = []
    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    for node in program.graph.nodes:
        val = node.meta.get("val")
        is_user = node.op == "placeholder" and node.name in user
        if is_user and isinstance(val, torch.Tensor) and val.dim() > 0 and is_concrete_int(val.shape[0]):
            out.append(f"{node.name} (fixed to {int(val.shape[0])})")
    return out


def private_buffers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its parameters shared and its buffers copied, in the mode it was passed in.

    Running the model (the FP32 reference) or its exported program writes the buffers ``forward`` updates
    (BatchNorm's running statistics and ``num_batches_tracked`` in train mode) in place; on the copy the
    user's model stays bit-identical, in whichever mode it was given. Parameters are shared, not copied
    (no second copy of the weights; nothing writes them).
    """
    memo: dict[int, Any] = {id(p): p for p in model.parameters()}
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # an attribute that cannot be copied (a lock, a handle): trace the model itself
        log.debug("cannot copy the model's buffers (%s): tracing the model itself", exc)
        return model


def export_model(
    model: torch.nn.Module,
    inputs: Inputs,
    *,
    dynamic_batch: bool = False,
    dynamic_dims: DynamicDims | None = None,
    what: str = "the model",
) -> ExportedProgram:
    """Trace ``model`` with ``torch.export.export(..., strict=False)``.

    Args:
        model: The module to trace.
        inputs: ``(args, kwargs)``.
        dynamic_batch: Make dim 0 of every tensor input dynamic.
        dynamic_dims: Also make these dims of these named inputs dynamic (``{"ids": [1]}``).
        what: What is traced, for messages.

    Raises:
        ExportError: Naming the failing operation and the user's source line; the original exception
            is chained for ``--debug``.
        ConfigError: A ``dynamic_dims`` entry that does not fit the model, or that the model fixes.
    """
    args, kwargs = copy.deepcopy(inputs)  # tracing may mutate stateful inputs (caches); keep the caller's intact
    dynamic = (
        dynamic_shapes_for(model, args, kwargs, batch=dynamic_batch, dims=dynamic_dims)
        if dynamic_batch or dynamic_dims
        else None
    )
    program = _batch_two_export(model, args, kwargs, dynamic_dims) if dynamic_batch else None
    if program is None:
        program = _export(model, args, kwargs, dynamic, what)
    check_dynamic(program, dynamic_dims or {})
    return program


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: Any, what: str) -> ExportedProgram:
    # torch.export prints partial graphs and internal warnings to stderr; keep them for --debug
    # (the amplite logger at DEBUG level) instead of burying the one-line error under them.
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stderr(chatter):
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        log.debug("torch.export output:\n%s", chatter.getvalue())
        raise ExportError(
            f"torch.export could not trace {what} {export_failure(exc)}",
            "make that line traceable (no data-dependent Python control flow: use torch.cond or "
            "tensor ops; no unsupported Python objects), or run with --debug for the full trace",
        ) from exc
    if chatter.getvalue():
        log.debug("torch.export output:\n%s", chatter.getvalue())
    return program


def _batch_two_export(model: torch.nn.Module, args: tuple, kwargs: dict, dims: DynamicDims | None) -> Any:
    """The program traced at a batch-2 copy of a batch-1 example, or None (not batch 1, or it differs).

    torch.export specialises every dim whose example size is 0 or 1, whatever ``dynamic_shapes`` asks, so a
    batch-1 example (how most vision models are exported) gives a program fixed to batch 1. Traced at two
    copies of the example, dim 0 stays symbolic. The program is kept only if, run at the user's batch-1
    example, it gives the model's outputs (shapes, and values within 1e-4): a model that branches on
    ``batch == 1`` (``squeeze(0)``, a size test) traces another program at batch 2, and then the batch-1
    trace stands (its warning names the cause). Train-mode models are left alone: running them updates
    their statistics (an exported GraphModule's mode is fixed in its graph, whatever ``training`` says).
    """
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    # a GraphModule (a .pt2's program re-exported) has its train/eval choice baked into the graph
    if (model.training and not isinstance(model, torch.fx.GraphModule)) or not leaves:
        return None
    if any(x.shape[0] != 1 for x in leaves):
        return None
    two = pytree.tree_map(lambda x: torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x,
                          (args, kwargs))  # fmt: skip
    try:
        program = _export(model, *two, dynamic_shapes_for(model, *two, batch=True, dims=dims), "")
        if static_batch_inputs(program):
            return None
        with torch.no_grad():
            got = pytree.tree_leaves(program.module()(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
            want = pytree.tree_leaves(model(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
    except Exception as exc:  # the batch-1 trace below raises the user's error, if any
        log.debug("tracing at a batch-2 copy of the example failed: %s", exc)
        return None
    same = len(got) == len(want) and all(
        (a == b if not isinstance(a, torch.Tensor) else isinstance(b, torch.Tensor) and a.shape == b.shape
         and a.dtype == b.dtype and (not a.is_floating_point() or torch.allclose(a, b, rtol=1e-4, atol=1e-4)))
        for a, b in zip(got, want, strict=False)
    )  # fmt: skip
    if not same:
        log.debug("the program traced at batch 2 differs from the model at batch 1: keeping the batch-1 trace")
    return program if same else None


def static_batch_warning(program: ExportedProgram) -> str | None:
    """The report's warning when ``--dynamic-batch`` left dim 0 of a user input static, naming the cause."""
    static = static_batch_inputs(program)
    if not static:
        return None
    if all(s.endswith("(fixed to 1)") for s in static):
        return (f"--dynamic-batch: dim 0 of {', '.join(static)} stayed static: torch.export fixes a dim whose "
                "example size is 1, and the model traced at two copies of the example failed or gave other "
                "outputs at batch 1 (it branches on the batch size): give an example of batch >= 2")  # fmt: skip
    return f"--dynamic-batch: dim 0 of {', '.join(static)} stayed static: the model's code fixes that size"
