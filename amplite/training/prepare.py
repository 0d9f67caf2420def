"""``amplite.prepare_training``: a train-mode export, amplite's precision plan, masters and copies.

Steps: export the model in train mode (dropout live, BatchNorm on batch statistics, running statistics
updated in place), run amplite's passes with BatchNorm unfolded and kept FP32 (its running statistics
must stay the user's FP32 buffers), then give the graph the user's own parameters and buffers wherever
it reads them in FP32 and pair each low-precision copy with the user's parameter it came from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from amplite.converter.graph_stats import graph_stats, weight_bytes
from amplite.converter.inputs import bind_inputs, normalize_inputs
from amplite.converter.pipeline import rewrite
from amplite.converter.tracing import export_model
from amplite.errors import ConfigError, InputSpecError
from amplite.policy import Level, Override, PrecisionPolicy, make_overrides, resolve_level
from amplite.training.net import TrainingNet
from amplite.training.optim import MixedPrecisionOptimizer, check_optimizer, warn_o3

#: Training keeps BatchNorm in FP32 at every level: its running statistics are the user's FP32 buffers,
#: updated in place by the op, and a cast would send the update to a temporary copy.
BATCHNORM_FP32 = Override("keep_fp32", "op:batch_norm*")


@contextlib.contextmanager
def train_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` (every submodule) in train mode and restore each one's mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def prepare_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs: Any,
    *,
    precision: str = "bf16",
    level: str | Level | None = None,
    keep_fp32: tuple[str, ...] | list[str] = (),
    force_low: tuple[str, ...] | list[str] = (),
    dynamic_batch: bool = True,
) -> tuple[TrainingNet, MixedPrecisionOptimizer]:
    """Prepare ``model`` for mixed-precision training with ``optimizer``.

    Args:
        model: The FP32 model; its parameters stay the FP32 master weights and its buffers receive the
            BatchNorm running statistics. Nothing else of it changes.
        optimizer: The user's optimizer over ``model``'s parameters.
        example_inputs: One batch of inputs (a tensor, a tuple of args, or ``(args, kwargs)``).
        precision: ``bf16`` (plain backward) or ``fp16`` (dynamic loss scaling).
        level: ``O1`` (compute from the masters, casts in the graph), ``O2`` (low-precision weight copies),
            ``O3`` (everything low, no FP32 masters), ``O0`` (FP32); None reads ``AMPLITE_LEVEL``, else O1.
        keep_fp32: Extra keep-FP32 patterns (as for ``amplite.convert``).
        force_low: Extra force-low patterns.
        dynamic_batch: Trace with a dynamic batch dimension (a smaller last batch still runs).

    Returns:
        ``(net, opt)``: the trainable converted module and the optimizer wrapper.

    Raises:
        AmpliteError: An untraceable train-mode forward (naming the op and source line), an optimizer
            over parameters that are not the model's, or a bad option.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prepare_training needs an nn.Module, got {type(model).__name__}", "pass the FP32 model")
    check_optimizer(model, optimizer)
    lvl = resolve_level(level)
    policy = PrecisionPolicy(precision, lvl, (BATCHNORM_FP32, *make_overrides(keep_fp32, force_low)))
    inputs = normalize_inputs(example_inputs)
    if inputs is None:
        raise InputSpecError("no example inputs: the model needs a batch to be traced", "pass one batch of inputs")
    bind_inputs(model, inputs)
    with train_mode(model):
        program = export_model(model, inputs, dynamic_batch=dynamic_batch, what="the model in train mode")
    if lvl is Level.O0:
        from amplite.converter.pipeline import strip_export_checks

        gm, records, plan = program.module(), [], []
        strip_export_checks(gm)
    else:
        done = rewrite(program, inputs, policy, fold_batchnorm=False)
        gm, records, plan = done.module, done.records, done.plan
    pairs = attach_user_tensors(gm, model)
    if lvl is Level.O3:
        warn_o3()
    info = {
        "precision": precision,
        "level": lvl.value,
        "low_copies": len(pairs),
        "masters": "none (rounded to the low dtype after each step)" if lvl is Level.O3 else "fp32",
        "records": records,
        "plan": plan,
        # facts of the FP32 program for reports; the program itself is not kept (its graph holds memory)
        "graph_before": graph_stats(program.graph, policy.low_dtype),
        "weight_bytes_before": weight_bytes(program),
    }
    net = TrainingNet(gm, info)
    net.train(model.training)
    opt = MixedPrecisionOptimizer(
        optimizer, pairs, policy.low_dtype, scaling=precision == "fp16" and lvl is not Level.O0,
        round_masters=lvl is Level.O3,
    )  # fmt: skip
    return net, opt


def attach_user_tensors(gm: torch.fx.GraphModule, model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Make ``gm`` hold the user's tensors where it reads them unchanged; pair the low copies with masters.

    Export already hands the graph the user's parameter objects and buffers sharing their storage; this
    makes that a guarantee (by name) rather than an accident, and finds each copy the
    ``store_low_params`` pass made (tied weights share one copy, hence one pair).

    Returns:
        ``(low copy, master)`` per low-precision parameter.
    """
    user_params = dict(model.named_parameters(remove_duplicate=False))
    user_buffers = dict(model.named_buffers(remove_duplicate=False))
    pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        master = user_params.get(name)
        if master is None:
            continue
        owner, attr = _owner(gm, name)
        if p.dtype == master.dtype:
            owner._parameters[attr] = master
        else:
            pairs.setdefault(id(p), (p, master))
    for name, b in list(gm.named_buffers(remove_duplicate=False)):
        mine = user_buffers.get(name)
        if mine is not None and b.dtype == mine.dtype and b is not mine:
            owner, attr = _owner(gm, name)
            owner._buffers[attr] = mine
    return list(pairs.values())


def _owner(gm: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (gm.get_submodule(path) if path else gm), attr


__all__ = ["MixedPrecisionOptimizer", "TrainingNet", "prepare_training"]
