"""The optimizer side of mixed-precision training: FP32 masters, low-precision copies, loss scaling.

:class:`MixedPrecisionOptimizer` wraps the user's optimizer, which keeps stepping the user's FP32
parameters (the masters). At O2/O3 the net computes with low-precision copies: their gradients are added
into the masters' FP32 ``.grad`` (after every backward, so accumulation over several backwards happens in
FP32) and the copies are refreshed from the masters after every step. Under fp16 the loss is scaled
(:class:`~amplite.training.scaler.LossScaler`); a step with non-finite gradients is skipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amplite.errors import AmpliteError
from amplite.training.scaler import LossScaler


class TrainingError(AmpliteError):
    """The training loop used the optimizer wrapper in an order that cannot be right."""


class MixedPrecisionOptimizer:
    """``opt`` of ``net, opt = amplite.prepare_training(...)``.

    Args:
        optimizer: The user's optimizer (over the model's FP32 parameters).
        pairs: ``(low copy, FP32 master)`` for every parameter the net holds in low precision.
        low_dtype: The low-precision dtype.
        scaling: Use dynamic loss scaling (fp16).
        round_masters: Round the masters to ``low_dtype`` after each step (O3: no FP32 masters).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        low_dtype: torch.dtype,
        *,
        scaling: bool,
        round_masters: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.pairs = pairs
        self.low_dtype = low_dtype
        self.scaler = LossScaler() if scaling else None
        self.round_masters = round_masters
        self.steps = 0  # steps attempted (taken + skipped)
        self._backward_done = False
        self._unscaled: bool | None = None  # found_inf of this step's unscale_, None before it

    # -- the optimizer interface -------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self.scaler.scale if self.scaler else 1.0

    @property
    def masters(self) -> list[nn.Parameter]:
        """Every parameter the wrapped optimizer steps (the model's FP32 parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss`` (times the loss scale under fp16); gradients end up in the FP32 masters."""
        (loss * self.scaler.scale if self.scaler else loss).backward(**kwargs)
        self._backward_done = True
        self._collect()

    def unscale_(self) -> None:
        """Divide the masters' gradients by the loss scale now (before clipping them). Once per step."""
        self._collect()
        if self.scaler is None:
            self._unscaled = False
            return
        if self._unscaled is not None:
            raise TrainingError("opt.unscale_() was called twice for one step", "call it once, before clipping")
        self._require_backward("opt.unscale_()")
        self._unscaled = self.scaler.unscale(p.grad for p in self.masters)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Unscale, skip on inf/NaN (lowering the scale), step the masters, refresh the low copies.

        Returns:
            Whether the step was taken (False: skipped for non-finite gradients).

        Raises:
            TrainingError: Under fp16 scaling, when no ``opt.backward(loss)`` preceded the step.
        """
        if closure is not None:
            raise TrainingError("opt.step(closure) is not supported", "compute the loss and call opt.backward(loss)")
        self._collect()
        found_inf = False
        if self.scaler is not None:
            self._require_backward("opt.step()")
            found_inf = self._unscaled if self._unscaled is not None else self.scaler.unscale(
                p.grad for p in self.masters
            )
            self.scaler.update(found_inf)
        if not found_inf:
            self.optimizer.step()
            self.refresh()
        self.steps += 1
        self._backward_done = False
        self._unscaled = None
        return not found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' and the low copies' gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for low, _ in self.pairs:
            low.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the low copies (rounding); at O3 round the masters too."""
        for low, master in self.pairs:
            if self.round_masters:
                master.copy_(master.to(self.low_dtype))
            low.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the loss-scaler state."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "amplite": {"scaler": self.scaler.state_dict() if self.scaler else None, "steps": self.steps},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output and refresh the low copies from the (reloaded) masters."""
        if "optimizer" not in state or "amplite" not in state:
            raise AmpliteError(
                "this optimizer state was not saved by amplite's optimizer wrapper",
                "load it into the wrapped optimizer (opt.optimizer.load_state_dict) or save opt.state_dict()",
            )
        self.optimizer.load_state_dict(state["optimizer"])
        scaler = state["amplite"].get("scaler")
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        self.steps = int(state["amplite"].get("steps", 0))
        self.refresh()

    # -- internals -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _collect(self) -> None:
        """Add the low copies' gradients into the masters' FP32 gradients and clear them."""
        for low, master in self.pairs:
            if low.grad is None:
                continue
            g = low.grad.to(torch.float32)
            if master.grad is None:
                master.grad = g
            else:
                master.grad.add_(g)
            low.grad = None

    def _require_backward(self, what: str) -> None:
        if not self._backward_done:
            raise TrainingError(
                f"{what} without opt.backward(loss) under fp16 loss scaling: the gradients are not scaled, "
                "so the step cannot be checked for overflow",
                "call opt.backward(loss) instead of loss.backward()",
            )

    def __repr__(self) -> str:
        scale = f", loss_scale={self.scaler.scale:g}" if self.scaler else ""
        return f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, low_copies={len(self.pairs)}{scale})"


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step FP32 parameters of ``model`` (they are the masters).

    Raises:
        AmpliteError: A parameter that is not the model's, or one that is not FP32.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AmpliteError(
            f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer",
            "pass the optimizer built over model.parameters()",
        )
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in names:
                raise AmpliteError(
                    f"the optimizer's parameter {pi} of group {gi} (shape {tuple(p.shape)}) is not a parameter "
                    "of the model: amplite steps the model's parameters as the FP32 masters",
                    "build the optimizer over model.parameters() (the same model you pass to prepare_training)",
                )
            if p.dtype != torch.float32:
                raise AmpliteError(
                    f"parameter {names[id(p)]!r} is {str(p.dtype).removeprefix('torch.')}: the model's "
                    "parameters are the FP32 master weights",
                    "pass the FP32 model (do not .half() or .to(bfloat16) it first)",
                )


def warn_o3() -> None:
    """O3 trains without FP32 masters: say so once."""
    warnings.warn(
        "amplite O3 trains everything in low precision without FP32 master weights (updates round to the "
        "low dtype): a speed baseline, not an accuracy-preserving setting; use O1 or O2 for training",
        stacklevel=3,
    )

