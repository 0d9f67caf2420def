"""One traced graph of a ``TrainingNet`` (a *variant*), the inputs it accepts, and how to trace another.

A variant is a train-mode export of the user's model for one calling convention (positional inputs,
keyword names, nesting) and a set of dynamic dimensions, rewritten by amplite's passes, plus its eval twin.
It accepts exactly what ``torch.export``'s own program accepts: the same input structure, the same dtypes
and devices, and every dimension equal to the traced size unless it is dynamic and inside the range export
derived (relations between dims included: torch's own check does the unification). Nothing runs on a size
that was baked into the graph.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.export import Dim
from torch.export._tree_utils import reorder_kwargs
from torch.utils import _pytree as pytree

from amplite.converter.graph_stats import graph_stats, weight_bytes
from amplite.converter.inputs import bind_inputs
from amplite.converter.pipeline import rewrite, strip_export_checks
from amplite.describe import summarize_exception
from amplite.errors import ConfigError, ExportError
from amplite.policy import Level
from amplite.spec import ConvertSpec
from amplite.training.batchnorm import fp32_statistics
from amplite.training.checkpointing import checkpoint_graph, mark_regions
from amplite.training.cumulative import traceable_momentum
from amplite.training.lowcast import LowCopies, read_user_tensors
from amplite.training.signature import spelled_out

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
#: (input path as ``pytree.keystr`` of ``(args, kwargs)``, dim) pairs traced dynamic.
DynamicSet = frozenset[tuple[str, int]]


@dataclass
class Variant:
    """A traced graph and what it accepts."""

    train: torch.fx.GraphModule
    eval: torch.fx.GraphModule
    in_spec: pytree.TreeSpec
    placeholders: list[Any]  # objects with ``.meta["val"]`` per user input, in the program's order
    range_constraints: dict[Any, Any]
    dynamic: DynamicSet  # what was asked to be dynamic
    info: dict[str, Any] = field(default_factory=dict)
    flat: torch.fx.GraphModule | None = None  # the whole train graph when ``train`` runs it in checkpointed parts

    def flatten(self, args: tuple, kwargs: dict) -> list[tuple[Any, Any]] | None:
        """The inputs flattened in the program's order, or None when their structure differs."""
        try:
            kwargs = reorder_kwargs(kwargs, self.in_spec) if kwargs else kwargs
        except (ValueError, KeyError, TypeError, AssertionError):
            return None
        flat, spec = pytree.tree_flatten_with_path((args, kwargs))
        return flat if spec == self.in_spec else None

    def mismatch(self, flat: list[tuple[Any, Any]]) -> tuple[str, str] | None:
        """``(kind, why)`` ``flat`` (from :meth:`flatten`) does not fit this graph (kind ``dtype`` or
        ``shape``); None when it fits."""
        for (path, arg), holder in zip(flat, self.placeholders, strict=True):
            val = holder.meta.get("val")
            if (isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor)
                    and (arg.dtype != val.dtype or arg.device != val.device)):  # fmt: skip
                return "dtype", (
                    f"input {pytree.keystr(path)} is {_dt(arg.dtype)} on {arg.device}; the graph was traced "
                    f"with {_dt(val.dtype)} on {val.device}"
                )
        try:
            torch._export.utils._check_input_constraints_for_graph(self.placeholders, flat, self.range_constraints)
        except (RuntimeError, AssertionError, TypeError) as exc:
            return "shape", str(exc).splitlines()[0]
        return None

    def differing_dims(self, flat: list[tuple[Any, Any]]) -> set[tuple[str, int]]:
        """Dims of ``flat`` whose size differs from a size this graph has baked in."""
        found = set()
        for (path, arg), holder in zip(flat, self.placeholders, strict=True):
            val = holder.meta.get("val")
            if isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor) and arg.dim() == val.dim():
                for d, (a, v) in enumerate(zip(arg.shape, val.shape, strict=True)):
                    if isinstance(v, int) and a != v:
                        found.add((pytree.keystr(path), d))
        return found


    def explain(self, flat: list[tuple[Any, Any]], fallback: str) -> str:
        """Why ``flat`` does not fit this graph, in amplite's words (``fallback``: torch's, trimmed)."""
        for (path, arg), holder in zip(flat, self.placeholders, strict=True):
            val = holder.meta.get("val")
            if not (isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor)):
                continue
            name = input_name(path)
            if arg.dim() != val.dim():
                return f"input {name} has {arg.dim()} dims; a graph was traced with {val.dim()}"
            for d, (a, v) in enumerate(zip(arg.shape, val.shape, strict=True)):
                if isinstance(v, int):
                    if a != v:
                        return f"input {name} has size {a} at dim {d}; a graph was traced with that size fixed at {v}"
                    continue
                rng = self.range_constraints.get(v.node.expr)
                if rng is not None and not (int(rng.lower) <= a <= rng.upper):
                    return (f"input {name} has size {a} at dim {d}, outside the sizes {int(rng.lower)}.."
                            f"{rng.upper} a graph was traced for")  # fmt: skip
        return fallback.split(" If you meant")[0]


def input_name(path: Any) -> str:
    """``x``, ``labels`` or ``#0``, then any nesting below it, for a ``(args, kwargs)`` pytree path."""
    head, *rest = path[1:] if len(path) > 1 else (path[0],)
    name = repr(head.key) if isinstance(head, pytree.MappingKey) else f"#{getattr(head, 'idx', head)}"
    return name + (pytree.keystr(tuple(rest)) if rest else "")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def initial_dynamic(inputs: Inputs, model: nn.Module, batch: bool, dims: dict[str, list[int]]) -> DynamicSet:
    """The dims asked to be dynamic: dim 0 of every tensor with ``batch``, plus named inputs' ``dims``."""
    args, kwargs = inputs
    chosen: set[tuple[str, int]] = set()
    names: dict[str, str] = {}
    try:  # positional inputs can be named too: map forward()'s parameter names onto input paths
        params = list(inspect.signature(model.forward).parameters)
        names = {p: pytree.keystr((pytree.SequenceKey(0), pytree.SequenceKey(i)))
                 for i, p in enumerate(params[: len(args)])}  # fmt: skip
    except (TypeError, ValueError):
        pass
    names.update({k: pytree.keystr((pytree.SequenceKey(1), pytree.MappingKey(k))) for k in kwargs})
    for name in dims:
        if name not in names:
            raise ConfigError(f"dynamic_dims names {name!r}, which is not an input of this batch",
                              f"name one of: {', '.join(names) or 'none'}")  # fmt: skip
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    for path, leaf in flat:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        key = pytree.keystr(path)
        if batch:
            chosen.add((key, 0))
        for name, wanted in dims.items():
            if key.startswith(names[name]):
                chosen |= {(key, d % leaf.dim()) for d in wanted}
    return frozenset(chosen)


def _dynamic_shapes(model: nn.Module, inputs: Inputs, dynamic: DynamicSet) -> Any:
    """``dynamic_shapes`` for ``torch.export`` (``Dim.AUTO`` on every chosen dim), by forward()'s names."""
    args, kwargs = inputs
    by_path: dict[str, set[int]] = {}
    for key, d in dynamic:
        by_path.setdefault(key, set()).add(d)

    def spec(path: Any, leaf: Any) -> Any:
        dims = by_path.get(pytree.keystr(path)) if isinstance(leaf, torch.Tensor) else None
        return {d: Dim.AUTO for d in sorted(dims)} if dims else None

    specs_args, specs_kwargs = pytree.tree_map_with_path(spec, (args, kwargs))
    try:
        return dict(inspect.signature(model.forward).bind(*specs_args, **specs_kwargs).arguments)
    except (TypeError, ValueError):
        return (*specs_args, *specs_kwargs.values())


@contextlib.contextmanager
def tracing_context(model: nn.Module) -> Iterator[dict[str, int]]:
    """Train mode, grad on, the class's own ``forward``, no KV cache; checkpointed calls tagged.

    Yields:
        ``{"regions": n}``: how many outermost ``torch.utils.checkpoint`` calls the forward made (their
        nodes are tagged for :func:`~amplite.training.checkpointing.checkpoint_graph`).
    """
    modes = [(m, m.training) for m in model.modules()]
    momentum = traceable_momentum(model)
    patched = model.__dict__.pop("forward", None)  # an integration's patched forward: trace the real one
    config = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None)
    try:
        model.train()
        if cache is True:
            config.use_cache = False
        with mark_regions() as seen, torch.inference_mode(False), torch.enable_grad(), momentum:
            yield seen
    finally:
        if cache is True:
            config.use_cache = True
        if patched is not None:
            model.forward = patched
        for m, mode in modes:
            m.training = mode
    if cache is True:
        warnings.warn(
            "amplite traces the model for training with use_cache=False (config.use_cache is True): a KV cache "
            "is for generation, training keeps none; the model's config is unchanged",
            stacklevel=4,
        )


_QUIET = ("torch.export", "torch._export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
          "torch._subclasses")  # fmt: skip


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """torch.export's stderr output and log records are kept for ``--debug``, not printed before our error."""
    chatter = io.StringIO()
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(chatter), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield chatter
        for w in caught:  # torch's own deprecation notices are not the user's concern; the model's warnings are
            if issubclass(w.category, (FutureWarning, DeprecationWarning)):
                chatter.write(f"{w.category.__name__}: {w.message}\n")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if chatter.getvalue():
            logging.getLogger("amplite").debug("torch.export output:\n%s", chatter.getvalue())


def _export(model: nn.Module, inputs: Inputs, shapes: Any) -> torch.export.ExportedProgram:
    args, kwargs = copy.deepcopy(inputs)  # tracing may mutate stateful inputs (caches); keep the caller's intact
    try:
        with _quiet():
            return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:
        raise ExportError(
            f"torch.export could not trace the model in train mode: {summarize_exception(exc)}",
            "make that line traceable (no data-dependent Python control flow: use torch.cond or "
            "tensor ops; no unsupported Python objects); torch.export's full error is this error's __cause__ and "
            "its output is logged to the 'amplite' logger at DEBUG",
        ) from exc


def trace_variant(
    model: nn.Module, inputs: Inputs, spec: ConvertSpec, dynamic: DynamicSet, copies: LowCopies
) -> Variant:
    """Export ``model`` in train mode on ``inputs``, run amplite's passes as ``spec`` says (made by
    ``amplite.training.prepare.for_training``), read the user's tensors.

    Raises:
        AmpliteError: Inputs that do not fit ``forward``, an untraceable forward.
    """
    from amplite.training.net import to_eval_graph

    bind_inputs(model, inputs, fix="pass the batch as forward() takes it: a tensor, a tuple of positional inputs, "
                "or (args, kwargs) with forward()'s parameter names")
    with tracing_context(model), spelled_out(model, inputs[1]):
        shapes = _dynamic_shapes(model, inputs, dynamic) if dynamic else None
        program = _export(model, inputs, shapes)
    user_inputs = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    holders = [types.SimpleNamespace(meta={"val": n.meta.get("val")})
               for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]  # fmt: skip
    if spec.level is Level.O0:
        gm, records, plan = program.module(), [], []
        strip_export_checks(gm)
    else:
        done = rewrite(program, inputs, spec)
        gm, records, plan = done.module, done.records, done.plan
    batchnorm = fp32_statistics(gm, model) if spec.level is not Level.O0 else {}
    low = read_user_tensors(gm, model, copies)
    eval_gm, counters = to_eval_graph(gm)
    runner, regions = checkpoint_graph(gm)  # checkpointed regions recompute in backward (eval needs none)
    info = {
        "low_copies": low,
        "records": records,
        "plan": plan,
        "mode_switch": counters,
        "batchnorm": dict(batchnorm),
        "checkpointed_regions": regions,
        # facts of the FP32 program for reports; the program itself is not kept (its graph holds memory)
        "graph_before": graph_stats(program.graph, spec.precision),
        "weight_bytes_before": weight_bytes(program),
    }
    return Variant(
        runner, eval_gm, program.call_spec.in_spec, holders, dict(program.range_constraints), dynamic, info, flat=gm
    )
