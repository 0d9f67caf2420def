"""The trainable converted module: a train-mode graph, its eval-mode twin, and the weights they share.

The graph comes from a train-mode ``torch.export`` (training IR: ``aten.dropout(x, p, train=True)``,
``aten.batch_norm(..., training=True, ...)`` updating the running statistics in place, and an ``add_`` on
``num_batches_tracked``). The eval graph is the same graph with those flags off and the counter update
removed, as ``torch.ao``'s ``move_exported_model_to_eval`` did for pt2e graphs; both graphs read the same
tensor objects, so switching costs nothing and never copies a weight.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
from torch import nn

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

    Its parameters are the user's FP32 parameters where a graph reads them in FP32 (all of them at O1:
    the casts are in the graph) and low-precision copies where the graph reads only a low-precision
    version (O2/O3); :class:`~amplite.training.optim.MixedPrecisionOptimizer` keeps the copies in step with
    the masters. Buffers (BatchNorm's running statistics) are the user's own.

    Args:
        train_graph: The rewritten train-mode GraphModule.
        info: What ``prepare_training`` decided (precision, level, pairs, counters), for reports.
    """

    def __init__(self, train_graph: torch.fx.GraphModule, info: dict[str, Any]) -> None:
        super().__init__()
        self.graph_module = train_graph
        eval_gm, counters = to_eval_graph(train_graph)
        # Not a registered submodule: it shares every tensor with ``graph_module`` and must not list them twice.
        object.__setattr__(self, "_eval_graph", eval_gm)
        self.info = {**info, "mode_switch": counters}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the train graph in train mode and the eval graph in eval mode."""
        graph = self.graph_module if self.training else self._eval_graph
        return graph(*args, **kwargs)

    def train(self, mode: bool = True) -> TrainingNet:
        """Switch between the train and eval graphs (the graph modules themselves have no mode)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        return self

    @property
    def eval_graph(self) -> torch.fx.GraphModule:
        """The eval-mode GraphModule (dropout off, BatchNorm on running statistics)."""
        return self._eval_graph
