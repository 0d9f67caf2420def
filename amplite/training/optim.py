"""The optimizer side of mixed-precision training: FP32 masters, low-precision copies, loss scaling.

:class:`MixedPrecisionOptimizer` is a ``torch.optim.Optimizer`` (schedulers, ``add_param_group``,
``state_dict`` and closures work) wrapping the user's optimizer, which keeps stepping the user's FP32
parameters (the masters). Their gradients arrive in FP32 through autograd itself (the low-precision copies
the graphs read are a differentiable cast of the masters, :mod:`amplite.training.lowcast`), so
accumulation over several backwards happens in FP32 whichever way backward is called. After every step
the copies are recast. Under fp16 the loss is scaled (:class:`~amplite.training.scaler.LossScaler`); a step
with non-finite gradients is skipped.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amplite.errors import AmpliteError
from amplite.training.lowcast import LowCopies
from amplite.training.scaler import LossScaler, shard_groups


class TrainingError(AmpliteError):
    """The training loop used the optimizer wrapper in an order that cannot be right."""


#: Optimizers whose ``step`` needs a closure (which re-runs forward and backward).
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """``opt`` of ``net, opt = amplite.prepare_training(...)``: a ``torch.optim.Optimizer``.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own (a scheduler changing the
    learning rate changes it there).

    Args:
        optimizer: The user's optimizer (over the model's FP32 parameters).
        copies: The low-precision copies the net's graphs read.
        model: The user's model (parameters added later must be its own).
        scaling: Use dynamic loss scaling (fp16).
        round_masters: Round the masters to the low dtype after each step (O3: no FP32 masters).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        copies: LowCopies,
        model: nn.Module,
        *,
        scaling: bool,
        round_masters: bool = False,
    ) -> None:  # the base __init__ would build param groups of its own: set up its hooks only
        self.optimizer = optimizer
        self.copies = copies
        self.model = model
        self.low_dtype = copies.dtype
        self.scaler = LossScaler() if scaling else None
        self.round_masters = round_masters
        self.steps = 0  # steps attempted (taken + skipped)
        self._traced = {id(p) for p in model.parameters()}  # the parameters the graphs were traced with
        self._backward_done = False
        self._unscaled: bool | None = None  # found_inf of this step's unscale_, None before it
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):  # fmt: skip
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    # -- the optimizer interface -------------------------------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self.scaler.scale if self.scaler else 1.0

    @property
    def masters(self) -> list[nn.Parameter]:
        """Every parameter the wrapped optimizer steps (the model's FP32 parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(low copy, FP32 master)`` for every parameter a graph read in low precision so far."""
        return [(low, m) for low, m in self.copies.pairs() if isinstance(m, nn.Parameter)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters must be FP32 parameters of the model."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_params(self.model, [{"params": params}], first_group=len(self.optimizer.param_groups))
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        late = [names[id(p)] for p in params if id(p) not in self._traced]
        if late:
            raise AmpliteError(
                f"parameter {late[0]!r} was added to the model after prepare_training: no traced graph reads it, "
                "so it would never get a gradient or change the output",
                "add the submodule before prepare_training (then its parameters are traced), or call "
                "prepare_training again with the model as it is now",
            )
        self.optimizer.add_param_group({**param_group, "params": params})

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss`` (times the loss scale under fp16); gradients end up in the FP32 masters."""
        (loss * self.scaler.scale if self.scaler else loss).backward(**kwargs)
        self._backward_done = True

    def unscale_(self) -> None:
        """Divide the masters' gradients by the loss scale now (before clipping them). Once per step."""
        if self.scaler is None:
            self._unscaled = False
            return
        if self._unscaled is not None:
            raise TrainingError("opt.unscale_() was called twice for one step", "call it once, before clipping")
        self._require_backward("opt.unscale_()")
        self._unscaled = self._unscale()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale, skip on inf/NaN (lowering the scale), step the masters, recast the low copies.

        Args:
            closure: For optimizers that re-evaluate the loss (LBFGS): runs ``net`` forward and
                ``loss.backward()`` and returns the loss (bf16 only: a closure cannot be loss-scaled).

        Returns:
            With a closure, what the wrapped optimizer's ``step(closure)`` returns (the loss), as torch's
            optimizers do. Without one, whether the step was taken (False: skipped for non-finite
            gradients under fp16).

        Raises:
            TrainingError: Under fp16 scaling, when no ``opt.backward(loss)`` preceded the step.
        """
        found_inf = False
        if closure is not None and self.scaler is not None:
            raise TrainingError("opt.step(closure) under fp16 loss scaling", "use bf16 with a closure optimizer")
        if self.scaler is not None:
            self._require_backward("opt.step()")
            found_inf = self._unscaled if self._unscaled is not None else self._unscale()
            self.scaler.update(found_inf)
        result: Any = None
        if not found_inf:
            result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            self.copies.after_step(round_masters=self.round_masters)
        self.steps += 1
        self._backward_done = False
        self._unscaled = None
        return result if closure is not None else not found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def refresh(self) -> None:
        """Recast the low copies from the masters now; at O3 round the masters first."""
        self.copies.refresh(round_masters=self.round_masters)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict (``state``, ``param_groups``) plus ``"amplite"`` (loss scaler,
        steps): a plain optimizer over the same parameters loads it (the extra key is ignored)."""
        return {
            **self.optimizer.state_dict(),
            "amplite": {"scaler": self.scaler.state_dict() if self.scaler else None, "steps": self.steps},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict`'s output, a plain optimizer's state dict (the loss scaler is kept as it
        is), or the ``{"optimizer", "amplite"}`` layout of amplite before 0.x; recast the low copies."""
        state = dict(state)
        extra = state.pop("amplite", None)
        inner = state.pop("optimizer", None) if "optimizer" in state and "param_groups" not in state else state
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise AmpliteError(
                f"this is not an optimizer state dict (keys: {', '.join(map(str, state)) or 'none'})",
                "pass what opt.state_dict() or a torch optimizer's state_dict() returned",
            )
        self.optimizer.load_state_dict(inner)
        scaler = (extra or {}).get("scaler")
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        if extra is not None:
            self.steps = int(extra.get("steps", 0))
        self.copies.refresh()

    # -- internals -----------------------------------------------------------------------------------------
    def _unscale(self) -> bool:
        """Unscale the masters' gradients; whether any rank sharing their shards found an inf/NaN."""
        if self.scaler is None:
            return False
        masters = self.masters
        device = masters[0].device if masters else None
        return self.scaler.unscale((p.grad for p in masters), shard_groups(masters), device)

    def _require_backward(self, what: str) -> None:
        if not self._backward_done:
            raise TrainingError(
                f"{what} without opt.backward(loss) under fp16 loss scaling: the gradients are not scaled, "
                "so the step cannot be checked for overflow",
                "call opt.backward(loss) instead of loss.backward()",
            )

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        scale = f", loss_scale={self.scaler.scale:g}" if self.scaler else ""
        return f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, low_copies={len(self.copies._copies)}{scale})"


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *, scaling: bool = False) -> None:
    """The optimizer must step FP32 parameters of ``model`` (they are the masters).

    Raises:
        AmpliteError: A parameter that is not the model's, one that is not FP32, or a closure optimizer
            under fp16 loss scaling.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AmpliteError(
            f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer",
            "pass the optimizer built over model.parameters()",
        )
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise AmpliteError("the optimizer is already amplite's", "pass the optimizer you built (opt.optimizer)")
    if scaling and isinstance(optimizer, CLOSURE_OPTIMIZERS):
        raise AmpliteError(
            f"{type(optimizer).__name__} re-evaluates the loss in a closure, which fp16 loss scaling cannot check "
            "for overflow",
            "train with precision='bf16' (closures work there), or use a closure-free optimizer",
        )
    _check_params(model, optimizer.param_groups)


def _check_params(model: nn.Module, groups: list[dict[str, Any]], first_group: int = 0) -> None:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for gi, group in enumerate(groups, start=first_group):
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

