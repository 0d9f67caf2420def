"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under amplite's training graphs.

The supported order is FSDP's own: ``fully_shard`` every layer and then the root, build the optimizer over
the sharded parameters, then ``amplite.prepare_training(model, optimizer, batch, level="O1")``. Then:

- **Masters**: the optimizer steps FSDP's sharded FP32 parameters (each rank its shard).
- **Tracing**: every unit is unsharded (a collective: all ranks call ``prepare_training``) and FSDP's hooks
  are set aside while ``torch.export`` traces the model with its full FP32 parameters; the graph reads FSDP's
  *unsharded* parameter objects, which FSDP2 keeps for the life of the module (their storage is freed when
  a unit reshards and refilled when it gathers again).
- **Per layer**: the graph is split by FSDP unit (:func:`unit_graph`, from each node's module path). Each
  unit's part runs inside that unit's own ``__call__``, so FSDP's pre-forward hook gathers its FP32 shards,
  the part casts them to the low dtype as the plan says (FP32 islands keep FP32), and the post-forward hook
  frees them again; the root part runs inside the root's ``__call__``. Backward re-gathers per unit through
  FSDP's own hooks, and the FP32 gradients of the unsharded parameters are reduce-scattered in FP32.

This is ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``'s memory layout with amplite's plan
in compute, except that the all-gather moves FP32 (the cast happens after the gather). So only the default
``MixedPrecisionPolicy()`` (no ``param_dtype``) is accepted. Levels O1 and O2, bf16 and fp16:

- **O2**: the low copies are :class:`~amplite.training.windowed.WindowedCopies`, cast inside each unit's
  gathered window, dropped when it ends, and recast from the re-gathered parameters in backward.
- **fp16**: the loss scaler's found-inf verdict is reduced over the masters' meshes
  (:func:`~amplite.training.scaler.shard_groups`), so every rank skips, steps and rescales alike.
- **Activation checkpointing**: each part's checkpointed regions are recomputed inside that part
  (:func:`unit_graph`), in the unit's backward window.
- **Refused**: O3 (it rounds the masters; here the graph reads the gathered copies, not the shards) and the
  ``on_change`` recast (a copy kept between forwards would outlive its gather).
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from amplite.errors import ConfigError
from amplite.policy import Level
from amplite.spec import ConvertSpec
from amplite.training.checkpointing import checkpoint_graph
from amplite.training.lowcast import LowCopies
from amplite.training.windowed import WindowedCopies

ORDER = ("fully_shard each layer and the root, build the optimizer over model.parameters(), then call "
         "amplite.prepare_training(model, optimizer, batch, precision='bf16', level='O1' or 'O2')")  # fmt: skip


def fsdp_units(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: module}`` of the modules ``fully_shard`` was applied to (``""``: the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def check_fsdp(model: nn.Module, spec: ConvertSpec, recast: str = "every_forward") -> dict[str, nn.Module]:
    """The FSDP units of ``model`` (empty when it is not sharded), after checking amplite can train them.

    Raises:
        ConfigError: A sharded submodule without a sharded root, a ``param_dtype`` policy, O3, the
            ``on_change`` recast.
    """
    units = fsdp_units(model)
    if not units:
        return units
    if "" not in units:
        raise ConfigError("fully_shard was applied to submodules but not to the model given to prepare_training",
                          f"also fully_shard the root model: {ORDER}")  # fmt: skip
    for name, unit in units.items():
        policy = getattr(unit._get_fsdp_state(), "_mp_policy", None)
        low = getattr(policy, "param_dtype", None)
        if low not in (None, torch.float32):
            raise ConfigError(
                f"fully_shard({name or 'model'}) gathers parameters in {str(low).removeprefix('torch.')}: amplite's "
                "plan needs the FP32 values (its FP32 islands) and casts the rest itself after the gather",
                "fully_shard without mp_policy (or MixedPrecisionPolicy() without param_dtype)",
            )
    if spec.level is Level.O3:
        raise ConfigError(
            "with fully_shard amplite trains at O0, O1 or O2, not O3: O3 rounds the masters, and under FSDP the "
            "graph reads the gathered copies of the shards, not the shards the optimizer steps",
            f"pass level='O2' (bf16 weights in compute, FP32 sharded masters) ({ORDER})",
        )
    if recast != "every_forward" and spec.level is Level.O2:
        raise ConfigError(
            f"recast={recast!r} keeps the low copies between forwards; under fully_shard a copy may live only "
            "while its layer is gathered",
            "leave recast='every_forward' (the default) with fully_shard",
        )
    return units


@contextlib.contextmanager
def unsharded(model: nn.Module, units: dict[str, nn.Module]) -> Iterator[None]:
    """Full FP32 parameters and no FSDP hooks while ``torch.export`` traces (every rank must enter)."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
    for unit in units.values():
        unit.unshard()
    try:
        yield
    finally:
        for unit in units.values():
            unit.reshard()
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


class InUnit(nn.Module):
    """Runs one unit's part of the graph inside that unit's ``__call__`` (FSDP's hooks gather and free).

    Args:
        inner: The part of the graph.
        unit: The ``fully_shard``-ed module (not registered as a submodule: its parameters are the model's).
    """

    def __init__(self, inner: torch.fx.GraphModule, unit: nn.Module, copies: LowCopies | None = None) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_unit", unit)
        object.__setattr__(self, "_copies", copies)

    def forward(self, *args: Any) -> Any:
        """The part's outputs, computed between the unit's pre- and post-forward hooks (its gathered window:
        O2's low copies cast in it are dropped before the post-forward hook reshards)."""
        with _as_forward(self._unit, _windowed(self.inner.forward, self._copies)):
            return self._unit(*args)


def run_in_root(model: nn.Module, graph: Any, args: tuple, kwargs: dict, copies: LowCopies | None = None) -> Any:
    """``graph(*args, **kwargs)`` inside the root's ``__call__`` (its hooks: lazy init, the root's gather);
    with :class:`~amplite.training.windowed.WindowedCopies`, autograd saves masters instead of copies."""
    saving = copies.saving_masters() if isinstance(copies, WindowedCopies) else contextlib.nullcontext()
    with saving, _as_forward(model, _windowed(graph.forward, copies)):
        return model(*args, **kwargs)


def _windowed(fn: Any, copies: LowCopies | None) -> Any:
    """``fn`` followed by dropping the window's low copies (before the unit's post-forward hook reshards)."""
    if not isinstance(copies, WindowedCopies):
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        copies.open += 1
        try:
            return fn(*args, **kwargs)
        finally:
            copies.open -= 1
            copies.release()

    return run


@contextlib.contextmanager
def _as_forward(module: nn.Module, forward: Any) -> Iterator[None]:
    """``module(...)`` calls ``forward`` while inside (an instance attribute: ``nn.Module.__setattr__`` would
    register a GraphModule as a submodule named ``forward`` and leave the class's forward in place)."""
    previous = module.__dict__.get("forward")
    object.__setattr__(module, "forward", forward)
    try:
        yield
    finally:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            object.__setattr__(module, "forward", previous)


def _unit_of(node: torch.fx.Node, paths: list[str]) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for fqn, _ in stack.values():
        fqn = str(fqn)
        if fqn in paths and (found is None or len(fqn) > len(found)):
            found = fqn
    return found


def unit_graph(gm: torch.fx.GraphModule, units: dict[str, nn.Module], copies: LowCopies | None = None,
               recompute: bool = False) -> torch.fx.GraphModule:  # fmt: skip
    """``gm`` split so that each non-root unit's nodes run in :class:`InUnit`; parameters are read inside.

    With ``recompute`` each part's checkpointed regions (:func:`~amplite.training.checkpointing.checkpoint_graph`)
    are recomputed in backward *inside* the part: a unit's recompute then runs in that unit's backward, after
    FSDP's pre-backward hook gathered its parameters again (as FSDP2 with ``checkpoint_wrapper`` does). A region
    spanning several units is recomputed piece by piece, one piece per unit.
    """
    paths = [p for p in units if p]
    _casts_at_first_use(gm.graph)
    gm.recompile()
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    owner: dict[torch.fx.Node, str | None] = {}
    for node in reversed(nodes):  # nodes amplite added (casts) go with their first user
        unit = _unit_of(node, paths)
        if unit is None and node.meta.get("nn_module_stack") is None:
            users = [u for u in node.users if u in owner]
            unit = owner[min(users, key=index.__getitem__)] if users else None
        owner[node] = unit
    parts, part, last = {}, -1, object()
    for node in nodes:
        if owner[node] != last:
            part, last = part + 1, owner[node]
        parts[node] = part
    if not any(owner.values()):
        return checkpoint_graph(gm)[0] if recompute else gm
    split = split_module(gm, gm, lambda n: parts[n], keep_original_order=True, keep_original_node_name=True)
    split.graph._codegen = copy.deepcopy(gm.graph._codegen)
    of_part = {parts[n]: owner[n] for n in nodes}
    for call in [n for n in split.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]:
        unit = of_part.get(int(call.target.removeprefix("submod_")))
        sub = getattr(split, call.target)
        if unit:
            _read_inside(split, call, sub)
        if recompute:
            sub = checkpoint_graph(sub)[0]
        setattr(split, call.target, InUnit(sub, units[unit], copies) if unit else sub)
    for node in [n for n in split.graph.nodes if n.op == "get_attr" and not n.users]:
        split.graph.erase_node(node)  # now read inside the parts (no general DCE: a part may only mutate)
    split.recompile()
    return split


def _casts_at_first_use(graph: torch.fx.Graph) -> None:
    """Move each low-copy read (``call_module`` of the copies, placed after its ``get_attr`` at the graph's
    top) to just before its first user: it then runs in that user's unit, inside its gathered window, rather
    than in a part of its own whose copy would be handed on after the gather ended."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "amplite_low_copies" and node.users:
            first = min(node.users, key=order.__getitem__)
            first.prepend(node)


def _read_inside(root: torch.fx.GraphModule, call: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    """Parameters the part reads become its own attributes: FSDP must not see them as inputs (it would wrap
    them for its post-backward hook, which would then run before their gradients are accumulated)."""
    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    keep = []
    for arg, holder in zip(call.args, holders, strict=True):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            name = "p_" + str(arg.target).replace(".", "_")
            setattr(sub, name, _attr(root, arg.target))
            with sub.graph.inserting_before(holder):
                holder.replace_all_uses_with(sub.graph.get_attr(name))
            sub.graph.erase_node(holder)
        else:
            keep.append(arg)
    call.args = tuple(keep)
    sub.recompile()


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
