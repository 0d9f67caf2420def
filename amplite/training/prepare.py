"""``amplite.prepare_training``: a train-mode export, amplite's precision plan, the user's tensors.

Steps: export the model in train mode (dropout live, BatchNorm on batch statistics, running statistics
updated in place), run amplite's passes with BatchNorm unfolded, reading the low-precision activation and
the user's FP32 weight, bias and running statistics (:mod:`amplite.training.batchnorm`), then make the
graph read the user's own parameters and buffers, through a cached low-precision cast where it wants them
low (:mod:`amplite.training.lowcast`). Batches another
graph must serve (shapes, keyword sets) are traced on first sight (:mod:`amplite.training.variants`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from amplite.converter.inputs import normalize_inputs
from amplite.errors import ConfigError, InputSpecError
from amplite.levels import resolve_level
from amplite.policy import Level, PrecisionPolicy, make_overrides
from amplite.training.batchnorm import BATCHNORM_LOW
from amplite.training.distributed import check_fsdp, unit_graph, unsharded
from amplite.training.lowcast import LowCopies
from amplite.training.net import TrainingNet
from amplite.training.optim import MixedPrecisionOptimizer, check_optimizer, warn_o3
from amplite.training.variants import initial_dynamic, trace_variant

RECASTS = ("every_forward", "on_change")


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
    dynamic_dims: Mapping[str, Sequence[int]] | None = None,
    max_graphs: int = 8,
    recast: str = "every_forward",
) -> tuple[TrainingNet, MixedPrecisionOptimizer]:
    """Prepare ``model`` for mixed-precision training with ``optimizer``.

    Args:
        model: The FP32 model; its parameters stay the FP32 master weights and its buffers receive the
            BatchNorm running statistics. Nothing else of it changes.
        optimizer: The user's optimizer over ``model``'s parameters.
        example_inputs: One batch of inputs (a tensor, a tuple of args, or ``(args, kwargs)``).
        precision: ``bf16`` (plain backward) or ``fp16`` (dynamic loss scaling).
        level: ``O1`` (compute from the masters, casts in the graph), ``O2`` (cached low-precision casts of
            the masters), ``O3`` (everything low, masters rounded), ``O0`` (FP32); None reads
            ``AMPLITE_LEVEL``, else O1.
        keep_fp32: Extra keep-FP32 patterns (as for ``amplite.convert``).
        force_low: Extra force-low patterns.
        dynamic_batch: Trace with a dynamic batch dimension (a smaller last batch runs the same graph).
        dynamic_dims: Also trace these dims dynamic, by input name (``{"input_ids": [1]}``). Dims not
            declared are discovered: a batch with another size there is traced once more with them dynamic.
        max_graphs: At most this many traced graphs (calling conventions or shapes one graph cannot cover).
        recast: When the O2/O3 low-precision copies are recast from the masters: ``every_forward``
            (default: before every call of the net, so edits the version counter misses — ``p.data.clamp_()``,
            an EMA through ``.data`` — are seen) or ``on_change`` (only when a master's version counter,
            storage or shape changed: one cast fewer per forward; after a ``.data`` edit call ``opt.refresh()``).

    Returns:
        ``(net, opt)``: the trainable converted module and the optimizer (a ``torch.optim.Optimizer``).

    Raises:
        AmpliteError: An untraceable train-mode forward (naming the op and source line), an optimizer
            over parameters that are not the model's, or a bad option.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prepare_training needs an nn.Module, got {type(model).__name__}", "pass the FP32 model")
    if precision not in ("bf16", "fp16"):
        raise ConfigError(f"precision {precision!r} is not one amplite trains with", "pass 'bf16' or 'fp16'")
    if max_graphs < 1:
        raise ConfigError(f"max_graphs={max_graphs} must be at least 1", "pass a positive number of graphs")
    if recast not in RECASTS:
        raise ConfigError(f"recast={recast!r} is not a recast mode", f"pass one of: {', '.join(RECASTS)}")
    lvl = resolve_level(level, source="the level= argument")
    scaling = precision == "fp16" and lvl is not Level.O0
    check_optimizer(model, optimizer, scaling=scaling)
    policy = PrecisionPolicy(precision, lvl, (BATCHNORM_LOW, *make_overrides(keep_fp32, force_low)))
    inputs = normalize_inputs(example_inputs)
    if inputs is None:
        raise InputSpecError("no example inputs: the model needs a batch to be traced", "pass one batch of inputs")
    copies = LowCopies(policy.low_dtype, every_forward=recast == "every_forward")
    units = check_fsdp(model, precision, lvl)  # fully_shard-ed: traced unsharded, run per unit
    tracer = functools.partial(_trace, model, policy, lvl, copies, units)
    first = tracer(inputs, initial_dynamic(inputs, model, dynamic_batch, dict(dynamic_dims or {})))
    if lvl is Level.O3:
        warn_o3()
    info = {
        "precision": precision,
        "level": lvl.value,
        "masters": "none (rounded to the low dtype after each step)" if lvl is Level.O3 else "fp32",
        "fsdp_units": len(units),
        "recast": recast,
    }
    net = TrainingNet(model, first, tracer, info, max_graphs=max_graphs, copies=copies)
    net.train(model.training)
    opt = MixedPrecisionOptimizer(optimizer, copies, model, scaling=scaling, round_masters=lvl is Level.O3)
    return net, opt


def _trace(model: nn.Module, policy: PrecisionPolicy, level: Level, copies: LowCopies, units: dict[str, nn.Module],
           inputs: Any, dynamic: Any):  # fmt: skip
    if not units:
        return trace_variant(model, inputs, policy, level, dynamic, copies)
    with unsharded(model, units):
        variant = trace_variant(model, inputs, policy, level, dynamic, copies)
    if variant.info["checkpointed_regions"]:
        raise ConfigError("activation checkpointing inside fully_shard-ed layers is not supported by amplite yet",
                          "turn checkpointing off under fully_shard, or use DDP with checkpointing")  # fmt: skip
    variant.flat = variant.flat or variant.train
    variant.train, variant.eval = unit_graph(variant.flat, units), unit_graph(variant.eval, units)
    return variant


__all__ = ["MixedPrecisionOptimizer", "TrainingNet", "prepare_training"]
