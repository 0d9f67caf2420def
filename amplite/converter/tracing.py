"""torch.export with errors a user can act on."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import traceback
from typing import Any

import torch
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from amplite.errors import ExportError

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
log = logging.getLogger("amplite")


def batch_dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """``dynamic_shapes`` that make dim 0 of every tensor input dynamic (``Dim.AUTO``)."""

    def spec(x: Any) -> Any:
        return {0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return tuple(pytree.tree_map(spec, list(args) + list(kwargs.values())))
    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def export_model(
    model: torch.nn.Module, inputs: Inputs, *, dynamic_batch: bool = False, what: str = "the model"
) -> ExportedProgram:
    """Trace ``model`` with ``torch.export.export(..., strict=False)``.

    Raises:
        ExportError: Naming the failing operation and the user's source line; the original exception
            is chained for ``--debug``.
    """
    args, kwargs = copy.deepcopy(inputs)  # tracing may mutate stateful inputs (caches); keep the caller's intact
    dynamic = batch_dynamic_shapes(model, args, kwargs) if dynamic_batch else None
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
