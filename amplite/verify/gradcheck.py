"""Training check (``--grad``): one backward pass through the FP32 and the converted model.

The loss is the user's (``module:function`` taking the model's outputs and returning a scalar) or, by
default, the sum of every floating-point output. Each parameter's gradient in the converted model is
compared with FP32 (SQNR, NaN/Inf) — a parameter that has no gradient in one of the models fails the
check, it is never skipped —, and the FP32 gradients are checked against the low dtype's range: the
fraction that would underflow to zero in fp16 without loss scaling, and a recommended initial loss scale
(see :func:`amplite.verify.ranges.recommend_loss_scale`). The check fails when the converted gradients
have NaN/Inf that FP32's lack or a parameter's gradient is missing; the SQNR figures are for judgement
(gradients of a model with low-precision activations are expected to be noisier than its outputs).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.describe import summarize_exception
from amplite.errors import ConfigError, InputSpecError
from amplite.verify.layerwise import node_error
from amplite.verify.ranges import recommend_loss_scale

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
LossFn = Callable[[Any], torch.Tensor]


def default_loss(outputs: Any) -> torch.Tensor:
    """Sum of every floating-point output, in FP32."""
    floats = [
        t.float().sum() for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not floats:
        raise InputSpecError(
            "the model has no floating-point output to take a gradient of", "pass --loss module:function"
        )
    return torch.stack(floats).sum()


def load_loss(spec: str | LossFn | None) -> tuple[LossFn, str]:
    """The loss function for ``spec`` (``module:function``, a callable or None) and its description.

    Raises:
        ConfigError: If the spec is malformed or does not import.
    """
    if spec is None:
        return default_loss, "sum of outputs"
    if callable(spec):
        return spec, getattr(spec, "__qualname__", "callable")
    mod_name, _, fn_name = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return getattr(importlib.import_module(mod_name), fn_name), spec
    except Exception as exc:
        raise ConfigError(f"cannot import --loss {spec}: {summarize_exception(exc)}", "write module:function") from exc


def _backward(
    model: torch.nn.Module, inputs: Inputs, loss_fn: LossFn, what: str
) -> tuple[float, dict[str, torch.Tensor | None]]:
    """Loss and the gradient of every trainable parameter (None for one the loss does not reach)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    try:
        with torch.enable_grad():
            loss = loss_fn(model(*inputs[0], **inputs[1]))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__}")
            loss.backward()
    except (InputSpecError, ConfigError):
        raise
    except Exception as exc:
        raise InputSpecError(
            f"the backward pass of {what} failed: {summarize_exception(exc)}",
            "check --loss (it gets the model's outputs and returns a scalar)",
        ) from exc
    grads = {k: (p.grad.detach().clone() if p.grad is not None else None) for k, p in params.items()}
    for p in params.values():  # leave the modules as they were
        p.grad = None
    return float(loss.detach().float()), grads


def gradient_check(
    reference: torch.nn.Module,
    converted: torch.nn.Module,
    ref_inputs: Inputs,
    conv_inputs: Inputs,
    *,
    loss: str | LossFn | None = None,
    low_dtype: torch.dtype = torch.float16,
    worst: int = 5,
) -> dict[str, Any]:
    """One backward pass through both models; the report section ``gradients``.

    Every trainable parameter of either model is accounted for: compared (SQNR, NaN/Inf), or listed in
    ``missing_gradients`` with the model that lacks it (no such parameter, or no gradient reaches it) —
    which fails the check, as NaN/Inf gradients do. (Folded BatchNorm has no parameters to train: check a
    graph converted with ``fold_batchnorm=False``, as ``amplite check --grad`` does.)

    Args:
        reference: The FP32 model (e.g. ``program.module()``). converted: The converted one.
        ref_inputs: The batch for the reference. conv_inputs: The same batch for the converted model.
        loss: ``module:function``, a callable taking the outputs, or None for the sum of outputs.
        low_dtype: The dtype whose underflow is measured.
        worst: How many parameters with the lowest gradient SQNR to list.
    """
    start = perf_counter()
    loss_fn, loss_name = load_loss(loss)
    ref_loss, ref_grads = _backward(reference, ref_inputs, loss_fn, "the FP32 model")
    conv_loss, conv_grads = _backward(converted, conv_inputs, loss_fn, "the converted model")
    rows, missing = [], []
    for name in [*ref_grads, *(k for k in conv_grads if k not in ref_grads)]:
        g, c = ref_grads.get(name), conv_grads.get(name)
        if g is None or c is None:
            missing.append(f"{name} ({_why_missing(name, ref_grads, conv_grads)})")
            continue
        err = node_error(g, c.to(g.dtype))
        if err is not None:
            rows.append({"parameter": name, "dtype": str(c.dtype).removeprefix("torch."), **err})
    rows.sort(key=lambda r: r["sqnr_db"])
    nonfinite = [r["parameter"] for r in rows if r["new_nonfinite"]]
    finite_sqnr = [r["sqnr_db"] for r in rows if math.isfinite(r["sqnr_db"])]
    section: dict[str, Any] = {
        "loss": loss_name,
        "reference_loss": ref_loss,
        "converted_loss": conv_loss,
        "parameters": len(rows),
        "min_sqnr_db": min((r["sqnr_db"] for r in rows), default=math.inf),
        "median_sqnr_db": sorted(finite_sqnr)[len(finite_sqnr) // 2] if finite_sqnr else None,
        "worst": rows[:worst],
        "nonfinite_parameters": nonfinite,
        "missing_gradients": missing,
        "underflow": recommend_loss_scale([g for g in ref_grads.values() if g is not None], low_dtype),
        "passed": not nonfinite and not missing,
        "seconds": round(perf_counter() - start, 4),
    }
    if missing and any(k.startswith("amplite_folded_") for k, _ in converted.named_parameters()):
        section["hint"] = "the converted model has folded BatchNorm: convert with --no-fold-batchnorm to train it"
    return section


def _why_missing(name: str, ref: dict[str, Any], conv: dict[str, Any]) -> str:
    parts = []
    for what, grads in (("FP32", ref), ("converted", conv)):
        if name not in grads:
            parts.append(f"not a trainable parameter of the {what} model")
        elif grads[name] is None:
            parts.append(f"no gradient in the {what} model")
    return "; ".join(parts)


def failure_reasons(section: dict[str, Any]) -> list[str]:
    """One line per way the gradient check failed (empty when it passed)."""
    reasons = []
    if section["nonfinite_parameters"]:
        reasons.append("gradients: NaN/Inf in " + ", ".join(section["nonfinite_parameters"][:5]))
    if section.get("missing_gradients"):
        miss = section["missing_gradients"]
        more = f" and {len(miss) - 5} more" if len(miss) > 5 else ""
        hint = f" — {section['hint']}" if section.get("hint") else ""
        reasons.append(f"gradients: {len(miss)} parameter(s) not compared: " + ", ".join(miss[:5]) + more + hint)
    return reasons
