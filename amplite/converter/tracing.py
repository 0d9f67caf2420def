"""torch.export with errors a user can act on."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import re
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.export import Dim, ExportedProgram
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from amplite.errors import ConfigError, ExportError

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
log = logging.getLogger("amplite")


DynamicDims = Mapping[str, Sequence[int]]

_DIM_SPEC = re.compile(r"^(?P<name>[A-Za-z_][\w.]*):(?P<dims>-?\d+(?:,-?\d+)*)$")


def parse_dynamic_dims(specs: Sequence[str] | Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """``["ids:1", "x:0,2"]`` (``--dynamic-dim NAME:DIM[,DIM]``) or a mapping -> ``{name: [dims]}``.

    Raises:
        ConfigError: A spec that does not parse.
    """
    if not specs:
        return {}
    if isinstance(specs, Mapping):
        return {str(k): [int(d) for d in ([v] if isinstance(v, int) else v)] for k, v in specs.items()}
    out: dict[str, list[int]] = {}
    for spec in specs:
        m = _DIM_SPEC.match(spec.strip())
        if not m:
            raise ConfigError(f"cannot parse --dynamic-dim {spec!r}", "write NAME:DIM[,DIM], e.g. ids:1 or x:0,2")
        out.setdefault(m["name"], []).extend(int(d) for d in m["dims"].split(","))
    return out


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
    # torch.export prints partial graphs and internal warnings to stderr; keep them for --debug
    # (the amplite logger at DEBUG level) instead of burying the one-line error under them.
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stderr(chatter):
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        log.debug("torch.export output:\n%s", chatter.getvalue())
        raise ExportError(
            f"torch.export could not trace {what}: {summarize_exception(exc)}",
            "make that line traceable (no data-dependent Python control flow: use torch.cond or "
            "tensor ops; no unsupported Python objects), or run with --debug for the full trace",
        ) from exc
    if chatter.getvalue():
        log.debug("torch.export output:\n%s", chatter.getvalue())
    check_dynamic(program, dynamic_dims or {})
    return program


def summarize_exception(exc: BaseException) -> str:
    """First line of an exception plus the innermost user-code frame that raised it."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    if len(head) > 240:
        head = head[:237] + "..."
    where = user_frame(exc)
    return f"{type(exc).__name__}: {head}" + (f" (at {where})" if where else "")


def user_frame(exc: BaseException) -> str:
    """'file:line (code)' of the innermost traceback frame outside torch, amplite and site-packages."""
    best = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        f = frame.filename
        if any(s in f for s in ("/torch/", "site-packages", "/amplite/", "<frozen", "/contextlib.py")):
            continue
        best = f"{f}:{frame.lineno}" + (f" `{frame.line.strip()}`" if frame.line else "")
    return best
