"""The trainable converted module: a train-mode graph, its eval-mode twin, and the weights they share.

The graph comes from a train-mode ``torch.export`` (training IR: ``aten.dropout(x, p, train=True)``,
``aten.batch_norm(..., training=True, ...)`` updating the running statistics in place, and an ``add_`` on
``num_batches_tracked``). The eval graph is the same graph with those flags off and the counter update
removed, as ``torch.ao``'s ``move_exported_model_to_eval`` did for pt2e graphs; both graphs read the same
tensor objects, so switching costs nothing and never copies a weight.

A ``TrainingNet`` holds one or more such graph pairs (:class:`~amplite.training.variants.Variant`): a batch
that no graph accepts as strictly as ``torch.export``'s own program would (another keyword set, a size baked
into the graph) is traced once more, with the dims whose size changed made dynamic, into a bounded cache;
every graph reads the same user parameters and the same low-precision copies.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.fx
from torch import nn

from amplite.errors import ConfigError, InputSpecError
from amplite.training.cumulative import CumulativeStats
from amplite.training.distributed import ORDER as FSDP_ORDER
from amplite.training.distributed import fsdp_units, run_in_root
from amplite.training.lowcast import LowCopies
from amplite.training.watch import ModelWatch

_aten = torch.ops.aten
#: Ops whose last positional argument is ``train`` (a bool): dropout flavours in the training IR.
_DROPOUTS = (_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default)  # fmt: skip
_BATCH_NORM = _aten.batch_norm.default  # args: input, weight, bias, mean, var, training, momentum, eps, cudnn
_SDPA = _aten.scaled_dot_product_attention.default  # args: q, k, v, attn_mask, dropout_p, is_causal; scale=
_COUNTER = "num_batches_tracked"


def to_eval_graph(train_gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """An eval-mode GraphModule sharing every tensor with ``train_gm``.

    Afterwards: dropout nodes are gone (their input flows through), attention has ``dropout_p=0``,
    ``batch_norm`` uses the running statistics (``training=False``) and nothing increments
    ``num_batches_tracked``. Python branches on ``self.training`` other than these were traced in train mode.

    Returns:
        The eval module and counters (``dropout_disabled``, ``batchnorm_to_running_stats``).
    """
    with warnings.catch_warnings():  # copying the graph's pytree specs trips torch's own LeafSpec deprecation
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(train_gm.graph)
    counters = {"dropout_disabled": 0, "batchnorm_to_running_stats": 0, "attention_dropout_disabled": 0}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUTS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            counters["dropout_disabled"] += 1
        elif node.target is _BATCH_NORM and len(node.args) > 5 and node.args[5] is True:
            args = list(node.args)
            args[5] = False
            node.args = tuple(args)
            counters["batchnorm_to_running_stats"] += 1
        elif node.target is _SDPA and _sdpa_dropout(node):
            if len(node.args) > 4:
                node.args = (*node.args[:4], 0.0, *node.args[5:])
            else:
                node.kwargs = {**node.kwargs, "dropout_p": 0.0}
            counters["attention_dropout_disabled"] += 1
        elif node.target is _aten.add_.Tensor and _is_counter(node.args[0]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    return torch.fx.GraphModule(train_gm, graph), counters


def _sdpa_dropout(node: torch.fx.Node) -> bool:
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return p != 0.0


def _is_counter(arg: Any) -> bool:
    return isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and str(arg.target).endswith(_COUNTER)


class TrainingNet(nn.Module):
    """The converted model for training: call it like the original; ``train()``/``eval()`` switch graphs.

    Its parameters and buffers are the user's model's own (``net.parameters()`` is ``model.parameters()``,
    so ``clip_grad_norm_(net.parameters())`` and ``DDP(net)`` see every gradient); where a graph wants a
    weight in low precision it reads a cached cast of the user's parameter whose gradient flows back to
    that parameter in FP32. ``net.state_dict()`` is the model's FP32 state dict (the same keys);
    ``net.load_state_dict`` loads one into the model.

    Args:
        model: The user's FP32 model (registered as ``net.model``; the state-dict keys carry no prefix).
        variant: The first traced graph pair.
        tracer: ``tracer(inputs, dynamic) -> Variant`` traces another one.
        info: What ``prepare_training`` decided (precision, level, counters), for reports.
        max_graphs: At most this many graph pairs (distinct calling conventions or shapes one graph
            cannot cover); one more is an error.
    """

    def __init__(
        self,
        model: nn.Module,
        variant: Any,
        tracer: Any,
        info: dict[str, Any],
        max_graphs: int = 8,
        copies: LowCopies | None = None,
    ):
        super().__init__()
        self.model = model
        object.__setattr__(self, "_variants", [variant])
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "_copies", copies)
        object.__setattr__(self, "_watch", ModelWatch(model))
        object.__setattr__(self, "_cumulative", CumulativeStats(model))
        self.max_graphs = max_graphs
        self.info = {**info, **variant.info, "graphs": 1, "retraces": []}
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the train graph in train mode and the eval graph in eval mode (of the graph for this batch).

        The mode is the model's own (``model.eval()`` on the model you hold is followed); any other change
        to the model since the trace that the graphs cannot follow is refused (:mod:`.watch`). Every
        low-precision copy is the cast of its master's current value (:meth:`LowCopies.sync`). Under FSDP2
        (``info['fsdp_units']``) FSDP swaps sharded and unsharded parameter objects by design, so only the
        mode is followed, and the graph runs inside the root's own call (its hooks gather and reshard).
        """
        sharded = self.info.get("fsdp_units")
        self.training = self.model.training if sharded else self._mode()
        if self._copies is not None and not torch.compiler.is_compiling():
            self._copies.sync()
        variant = self._select(args, kwargs)
        graph = variant.train if self.training else variant.eval
        if sharded:
            out = run_in_root(self.model, graph, args, kwargs, self._copies)
        elif not self.training or not self._cumulative.modules:
            out = graph(*args, **kwargs)
        else:
            saved = self._cumulative.before()
            out = graph(*args, **kwargs)
            self._cumulative.after(saved)
        if self._copies is not None and not torch.compiler.is_compiling():
            self._copies.release()  # every_forward: autograd's references keep what backward needs
        return out

    def _mode(self) -> bool:
        """The watch's verdict, naming FSDP's order when the change is a ``fully_shard`` made afterwards."""
        try:
            return self._watch.mode()
        except ConfigError:
            if fsdp_units(self.model):
                raise ConfigError(
                    "fully_shard was applied after prepare_training (the model's parameters are now shards)",
                    f"apply it first: {FSDP_ORDER}",
                ) from None
            raise

    def _select(self, args: tuple, kwargs: dict) -> Any:
        reasons = []
        for i, variant in enumerate(self._variants):
            flat = variant.flatten(args, kwargs)
            if flat is None:
                continue
            found = variant.mismatch(flat)
            if found is None:
                if i:
                    self._variants.insert(0, self._variants.pop(i))  # most recently used first
                return variant
            kind, why = found
            if kind == "dtype":  # no graph of another shape fixes it
                raise InputSpecError(f"{why}", "give the batch the dtype and device of the example inputs "
                                     "(e.g. ids.long(), x.float(), .to(device)), or call prepare_training with one "
                                     "like it")  # fmt: skip
            reasons.append((variant, flat, why))
        return self._retrace(args, kwargs, reasons)

    def _retrace(self, args: tuple, kwargs: dict, reasons: list) -> Any:
        if len(self._variants) >= self.max_graphs:
            why = reasons[0][0].explain(reasons[0][1], reasons[0][2]) if reasons else (
                "a calling convention no graph was traced with")
            raise InputSpecError(
                f"this batch needs a graph of its own ({why}) and the net already holds {self.max_graphs}",
                "pass dynamic_dims= for the dims that vary (or pad/bucket the batches to fewer shapes), "
                "or raise max_graphs",
            )
        dynamic = set(self._variants[0].dynamic)
        for variant, flat, _ in reasons:
            dynamic |= variant.dynamic | variant.differing_dims(flat)
        new = self._tracer((args, kwargs), frozenset(dynamic))
        self._variants.insert(0, new)
        self._watch.snapshot()
        why = reasons[0][0].explain(reasons[0][1], reasons[0][2]) if reasons else (
            "a new calling convention (another set of inputs or keyword names)")
        self.info["graphs"] = len(self._variants)
        self.info["retraces"].append({"reason": why, "dynamic": sorted(f"{k}:{d}" for k, d in new.dynamic)})
        warnings.warn(
            f"amplite traced graph {len(self._variants)} of at most {self.max_graphs} for this batch: {why}. "
            "A trace takes as long as prepare_training; pass dynamic_dims= for dims that vary to skip it",
            stacklevel=6,  # _retrace, _select, forward, Module._call_impl, Module._wrapped_call_impl: the caller
        )
        return new

    def train(self, mode: bool = True) -> TrainingNet:
        """Switch between the train and eval graphs: sets the model's mode (the graphs follow the model's)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        self.model.train(mode)
        return self

    # -- the net stands in for the model -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Attributes and methods the net lacks are the model's (``net.config``, ``net.estimate_mfu()``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            return getattr(model, name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """The model's parameters under the model's own names (the net has none of its own)."""
        if not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return self.model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """The model's buffers under the model's own names."""
        if not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The train-mode GraphModule most recently used (whole, also when it runs in checkpointed parts)."""
        variant = self._variants[0]
        return variant.flat if variant.flat is not None else variant.train

    @property
    def eval_graph(self) -> torch.fx.GraphModule:
        """The eval-mode GraphModule (dropout off, BatchNorm on running statistics) most recently used."""
        return self._variants[0].eval

    @property
    def graphs(self) -> int:
        """How many graph pairs the net holds (one per calling convention / shape family)."""
        return len(self._variants)

    def __getstate__(self) -> Any:
        raise ConfigError(
            "a TrainingNet holds traced graphs and is not pickled (torch.save(net), copy.deepcopy(net))",
            "save net.state_dict() (the model's FP32 state dict); load it with net.load_state_dict or "
            "model.load_state_dict, or save the model itself",
        )


def _strip_prefix(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
    """``net.state_dict()`` keys are the model's own: drop the ``model.`` level."""
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _add_prefix(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """``net.load_state_dict`` takes the model's keys: put them under ``model.``."""
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix) :]] = state.pop(key)
