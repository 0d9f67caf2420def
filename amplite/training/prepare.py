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
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from amplite.converter.inputs import normalize_inputs
from amplite.errors import ConfigError, InputSpecError
from amplite.policy import Level, Override
from amplite.spec import ConvertSpec, RangeSpec
from amplite.training.batchnorm import BATCHNORM_LOW
from amplite.training.distributed import check_fsdp, unit_graph, unsharded
from amplite.training.lowcast import LowCopies
from amplite.training.net import TrainingNet
from amplite.training.optim import MixedPrecisionOptimizer, check_optimizer, warn_o3
from amplite.training.variants import initial_dynamic, trace_variant
from amplite.training.windowed import WindowedCopies

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
    spec = training_spec(precision, level, keep_fp32, force_low)
    return prepare_spec(model, optimizer, example_inputs, spec, dynamic_batch=dynamic_batch,
                        dynamic_dims=dynamic_dims, max_graphs=max_graphs, recast=recast)  # fmt: skip


def training_spec(
    precision: str | torch.dtype | None = "bf16",
    level: str | Level | None = None,
    keep_fp32: Sequence[str | Override] = (),
    force_low: Sequence[str | Override] = (),
) -> ConvertSpec:
    """The spec of a training entry point's settings (``prepare_training``, the integrations), as
    :func:`for_training` makes it.

    Raises:
        ConfigError: A bad value, or a precision amplite does not train with (fp8).
    """
    spec = ConvertSpec.build(path="training", precision=precision, level=level, keep_fp32=keep_fp32,
                             force_low=force_low, level_name="the level= argument")  # fmt: skip
    return for_training(spec)


def for_training(spec: ConvertSpec) -> ConvertSpec:
    """``spec`` as training runs it: BatchNorm planned low with FP32 statistics
    (:data:`~amplite.training.batchnorm.BATCHNORM_LOW`) and, at bf16, the one range rule training applies
    (a small-integer ``pow`` follows its input: bf16 has FP32's exponent range, so no
    calibration is needed; no reduction-depth limit). fp16 would need calibrated ranges (a train-mode
    forward): none.

    Raises:
        ConfigError: An FP8 spec (amplite trains with bf16 or fp16).
    """
    if spec.fp8 is not None:
        raise ConfigError(f"precision {spec.precision_name!r} is not one amplite trains with", "pass 'bf16' or 'fp16'")
    pins = () if BATCHNORM_LOW in spec.overrides else (BATCHNORM_LOW,)
    ranges = RangeSpec(enabled=spec.precision is torch.bfloat16, max_reduction_depth=None)
    return replace(spec, overrides=(*pins, *spec.overrides), ranges=ranges)


def prepare_spec(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs: Any,
    spec: ConvertSpec,
    *,
    dynamic_batch: bool = True,
    dynamic_dims: Mapping[str, Sequence[int]] | None = None,
    max_graphs: int = 8,
    recast: str = "every_forward",
) -> tuple[TrainingNet, MixedPrecisionOptimizer]:
    """:func:`prepare_training` on a spec (made by :func:`training_spec` or :func:`for_training`)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prepare_training needs an nn.Module, got {type(model).__name__}", "pass the FP32 model")
    spec = for_training(spec)
    if max_graphs < 1:
        raise ConfigError(f"max_graphs={max_graphs} must be at least 1", "pass a positive number of graphs")
    if recast not in RECASTS:
        raise ConfigError(f"recast={recast!r} is not a recast mode", f"pass one of: {', '.join(RECASTS)}")
    lvl = spec.level
    scaling = spec.precision is torch.float16 and lvl is not Level.O0  # fp16's range needs loss scaling
    check_optimizer(model, optimizer, scaling=scaling)
    inputs = normalize_inputs(example_inputs)
    if inputs is None:
        raise InputSpecError("no example inputs: the model needs a batch to be traced", "pass one batch of inputs")
    units = check_fsdp(model, spec, recast)  # fully_shard-ed: traced unsharded, run per unit
    copies = WindowedCopies(spec.precision) if units else LowCopies(
        spec.precision, every_forward=recast == "every_forward")
    tracer = functools.partial(_trace, model, spec, copies, units)
    first = tracer(inputs, initial_dynamic(inputs, model, dynamic_batch, dict(dynamic_dims or {})))
    if lvl is Level.O3:
        warn_o3()
    info = {
        "precision": spec.precision_name,
        "level": lvl.value,
        "masters": "none (rounded to the low dtype after each step)" if lvl is Level.O3 else "fp32",
        "fsdp_units": len(units),
        "recast": recast,
    }
    net = TrainingNet(model, first, tracer, info, max_graphs=max_graphs, copies=copies)
    net.train(model.training)
    opt = MixedPrecisionOptimizer(optimizer, copies, model, scaling=scaling, round_masters=lvl is Level.O3)
    return net, opt


def _trace(model: nn.Module, spec: ConvertSpec, copies: LowCopies, units: dict[str, nn.Module], inputs: Any,
           dynamic: Any):  # fmt: skip
    if not units:
        return trace_variant(model, inputs, spec, dynamic, copies)
    with unsharded(model, units):
        variant = trace_variant(model, inputs, spec, dynamic, copies)
    variant.flat = variant.flat or variant.train
    recompute = bool(variant.info["checkpointed_regions"])  # recomputed per unit part, in its backward window
    variant.train = unit_graph(variant.flat, units, copies, recompute=recompute)
    variant.eval = unit_graph(variant.eval, units, copies)
    return variant


__all__ = [
    "MixedPrecisionOptimizer", "TrainingNet", "for_training", "prepare_spec", "prepare_training", "training_spec"
]
