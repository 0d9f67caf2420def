"""transformers' ``Trainer`` through amplite: ``AmpliteTrainer`` in place of ``Trainer``, the rest unchanged.

``TrainingArguments(bf16=True)`` (or ``fp16=True``) then means amplite's bf16 (fp16 with its dynamic loss
scaling) instead of autocast: the Trainer runs on a copy of the arguments with autocast off, and

- ``create_optimizer`` wraps the Trainer's optimizer (or one passed as ``optimizers=``) in
  :class:`AmpliteOptimizer`, a ``torch.optim.Optimizer`` sharing its parameter groups and state, so the
  Trainer's scheduler, ``optimizer.pt`` checkpoints and resume work as before;
- ``compute_loss`` and ``prediction_step`` call the model through amplite: the first batch runs
  ``amplite.prepare_training`` on the user's model with that optimizer, every batch then runs the converted
  train or eval graph (following the model's mode);
- the accelerator's ``backward`` and ``clip_grad_norm_`` become amplite's backward (scaled under fp16; the
  low-precision copies' gradients summed into the FP32 masters, so gradient accumulation sums in FP32) and
  an unscale before clipping the masters; ``optimizer.step()`` is amplite's (skip on inf/NaN, refresh the
  copies).

The model itself keeps the FP32 master weights, so ``save_model``/``save_pretrained`` write the FP32 checkpoint
that ``from_pretrained`` loads. Multi-process DDP (``torchrun``, ``accelerate launch``) trains through the
converted forward of the model DDP wraps; Accelerate's FSDP and DeepSpeed are refused, naming the FSDP2 routes
(see docs/training.md).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

try:
    import transformers
except ImportError as exc:  # an optional dependency: say which extra brings it
    raise ImportError(
        "amplite.integrations.transformers needs transformers and accelerate: pip install 'amplite[transformers]'"
    ) from exc
from torch import nn

from amplite.errors import AmpliteError, ConfigError
from amplite.integrations._lazy import LazyAmplite, original_forward, patch_forward


class AmpliteOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer, stepping through amplite once the first batch has been traced.

    ``torch.optim.Optimizer.__init__`` is not called: this object shares ``param_groups`` and ``state`` with
    ``inner`` (a scheduler over either writes the same learning rates).

    Args:
        inner: The optimizer over the model's FP32 parameters (the masters).
        amp: The lazy amplite state (settings; ``net``/``opt`` after the first batch).
    """

    def __init__(self, inner: torch.optim.Optimizer, amp: LazyAmplite) -> None:
        self.inner = inner
        self.amp = amp
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """amplite's step: masters stepped (unless fp16 skips the step), low copies refreshed."""
        if closure is not None:
            raise ConfigError("optimizer.step(closure) is not supported with amplite", "use a closure-free optimizer")
        if not self.amp.ready:
            raise AmpliteError(
                "no batch went through amplite's converted model before the optimizer step: the step would be FP32",
                "let AmpliteTrainer.compute_loss call the model (a compute_loss override should call super())",
            )
        self.amp.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' (and the low copies') gradients."""
        if self.amp.opt is not None:
            self.amp.opt.zero_grad(set_to_none=set_to_none)
        else:
            self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus ``"amplite"`` (loss scaler, steps)."""
        return {**self.inner.state_dict(), "amplite": self.amp.amplite_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a plain optimizer state dict loads too)."""
        state = dict(state_dict)
        amplite_state = state.pop("amplite", None)
        self.inner.load_state_dict(state)
        if amplite_state:
            self.amp.load_amplite_state(amplite_state)

    def __repr__(self) -> str:
        return f"AmpliteOptimizer({self.inner!r})"


class AmpliteTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through amplite.

    Args:
        *args: As for ``Trainer``.
        amplite_precision: ``bf16`` or ``fp16``; None: ``fp16`` if ``args.fp16`` else ``bf16``.
        amplite_level: ``O1``/``O2``/``O3``/``O0``; None reads ``AMPLITE_LEVEL`` (else O1).
        amplite_keep_fp32: Extra keep-FP32 patterns.
        amplite_force_low: Extra force-low patterns.
        **kwargs: As for ``Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        amplite_precision: str | None = None,
        amplite_level: str | None = None,
        amplite_keep_fp32: tuple[str, ...] = (),
        amplite_force_low: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        args = list(args)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            precision = amplite_precision or ("fp16" if training_args.fp16 else "bf16")
            # a copy with autocast off: the precision plan is in amplite's graph (the user's args stay as given)
            training_args = copy.copy(training_args)
            training_args.bf16 = training_args.fp16 = False
            training_args.mixed_precision = "no"
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args[1] = training_args
        else:
            precision = amplite_precision or "bf16"
        self._amplite_settings = (precision, amplite_level, tuple(amplite_keep_fp32), tuple(amplite_force_low))
        LazyAmplite(*self._amplite_settings)  # a bad setting fails now, not at the first batch
        super().__init__(*args, **kwargs)
        if self.optimizer is not None:  # passed as optimizers=(optimizer, scheduler)
            self.optimizer = self._wrap(self.optimizer)

    # -- the optimizer -----------------------------------------------------------------------------------
    def _wrap(self, optimizer: torch.optim.Optimizer) -> AmpliteOptimizer:
        if isinstance(optimizer, AmpliteOptimizer):
            return optimizer
        return AmpliteOptimizer(optimizer, LazyAmplite(*self._amplite_settings))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped in :class:`AmpliteOptimizer`."""
        super().create_optimizer(model)
        self.optimizer = self._wrap(self.optimizer)
        return self.optimizer

    def _amplite(self) -> AmpliteOptimizer | None:
        opt = self.optimizer
        while opt is not None and not isinstance(opt, AmpliteOptimizer):
            opt = getattr(opt, "optimizer", None)  # accelerate's AcceleratedOptimizer holds ours
        return opt

    def _ready(self) -> LazyAmplite | None:
        opt = self._amplite()
        return opt.amp if opt is not None and opt.amp.ready else None

    # -- the model ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _through_amplite(self, model: nn.Module) -> Iterator[None]:
        """While inside, ``model(...)`` runs amplite's converted graph (traced on the first call)."""
        opt = self._amplite()
        target = self.accelerator.unwrap_model(model)
        if opt is None or "forward" in target.__dict__:  # evaluation before training: the FP32 model
            yield
            return
        amp = opt.amp

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not amp.ready:
                _refuse_sharded(self.accelerator)
                with original_forward(target):
                    amp.prepare(target, opt.inner, args, kwargs)
            return amp.forward(target, *args, **kwargs)

        undo = patch_forward(target, forward)
        try:
            yield
        finally:
            undo()

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """``Trainer.compute_loss`` with the model called through amplite."""
        with self._through_amplite(model):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """``Trainer.prediction_step`` with the model called through amplite (its eval graph)."""
        with self._through_amplite(model):
            return super().prediction_step(model, inputs, *args, **kwargs)

    # -- backward and clipping ---------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with amplite's backward and an unscale before clipping."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        plain_backward, plain_clip = acc.backward, acc.clip_grad_norm_

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            amp = self._ready()
            if amp is None:
                return plain_backward(loss, **kwargs)
            amp.backward(loss / acc.gradient_accumulation_steps)  # 1: the Trainer accumulates itself
            return None

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
            amp = self._ready()
            if amp is not None:
                amp.unscale_once()  # the masters hold the true gradients before they are clipped
            return plain_clip(parameters, max_norm, norm_type)

        acc.backward = backward
        acc.clip_grad_norm_ = clip_grad_norm_

    @property
    def amplite_net(self) -> Any:
        """The converted :class:`~amplite.training.TrainingNet` (None before the first batch)."""
        opt = self._amplite()
        return opt.amp.net if opt is not None else None


def _refuse_sharded(accelerator: Any) -> None:
    """Under DDP the model the Trainer calls is ``DDP(model)``, whose forward reaches the converted one (so the
    reducer sees every gradient). Accelerate's FSDP (1 and 2) and DeepSpeed shard, reload and re-wrap the model
    in ``prepare``; Accelerate builds FSDP for GPU process types only, so the Trainer route cannot be tested
    on the CPU and stays refused, naming the FSDP2 routes that are tested."""
    kind = str(getattr(accelerator, "distributed_type", "")).upper()
    if "FSDP" in kind or "DEEPSPEED" in kind:
        raise ConfigError(
            f"AmpliteTrainer does not run under {kind.split('.')[-1]}: Accelerate shards and re-wraps the parameters "
            "the converted graph reads",
            "train with DDP (torchrun / accelerate launch without an FSDP or DeepSpeed config); for FSDP2 use "
            "fully_shard + amplite.prepare_training in your loop, or Lightning's ModelParallelStrategy with "
            "AmplitePrecision; or the Trainer's own bf16=True under FSDP",
        )


__all__ = ["AmpliteOptimizer", "AmpliteTrainer"]
