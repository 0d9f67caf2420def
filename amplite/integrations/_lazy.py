"""The shared part of the integrations: train through amplite from the first batch on.

Frameworks build the model, move it to its device and create the optimizer before the first batch, but
``amplite.prepare_training`` needs a batch to trace. :class:`LazyAmplite` holds the settings and the user's
optimizer until a forward call brings one, then prepares and keeps ``(net, opt)``. :func:`patch_forward`
makes a module's own ``forward`` go through it (an instance attribute, removed again by the returned undo),
so the framework and the user's code keep calling the model they know.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from amplite.training import MixedPrecisionOptimizer, TrainingNet
from amplite.training.prepare import prepare_spec, training_spec


class LazyAmplite:
    """``prepare_training`` on the first batch, with the settings given now.

    Args:
        precision: ``bf16`` or ``fp16``.
        level: ``O1``/``O2``/``O3``/``O0``; None reads ``AMPLITE_LEVEL`` (else O1), as ``prepare_training``.
        keep_fp32: Extra keep-FP32 patterns.
        force_low: Extra force-low patterns.
    """

    def __init__(self, precision: str, level: str | None, keep_fp32: tuple[str, ...], force_low: tuple[str, ...]):
        self.spec = training_spec(precision, level, tuple(keep_fp32), tuple(force_low))  # a bad value fails now
        self.net: TrainingNet | None = None
        self.opt: MixedPrecisionOptimizer | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # the user's optimizer the pair was built for
        self.pending_state: dict[str, Any] | None = None  # amplite state loaded before the first batch
        self._unscaled = False  # opt.unscale_() done for the current step

    @property
    def ready(self) -> bool:
        """Whether the first batch has been traced."""
        return self.net is not None

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Trace ``model`` on this batch; restore amplite state loaded before now."""
        # the first call may come from a validation step (no_grad / inference mode): the low-precision copies
        # made now must be ordinary trainable tensors
        with torch.inference_mode(False), torch.enable_grad():
            self.net, self.opt = prepare_spec(model, optimizer, (args, kwargs), self.spec)
        self.optimizer = optimizer
        if self.pending_state is not None:
            self.load_amplite_state(self.pending_state)
            self.pending_state = None

    def forward(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Run the converted net in ``model``'s mode."""
        assert self.net is not None
        self.net.train(model.training)
        return self.net(*args, **kwargs)

    # -- a step: backward, unscale (before clipping), step -------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scaled (fp16) backward; the gradients end up in the FP32 masters."""
        assert self.opt is not None
        self.opt.backward(loss, **kwargs)

    def unscale_once(self) -> None:
        """True gradients in the masters now (clipping reads them), at most once per step."""
        if self.opt is not None and not self._unscaled:
            self.opt.unscale_()
            self._unscaled = True

    def step(self) -> bool:
        """Step the masters and refresh the low copies; False when fp16 skipped the step."""
        assert self.opt is not None
        self._unscaled = False
        return self.opt.step()

    # -- state -------------------------------------------------------------------------------------------
    def amplite_state(self) -> dict[str, Any]:
        """The loss-scaler state and step count (the optimizer's own state is saved by the framework)."""
        if self.opt is not None:
            return dict(self.opt.state_dict()["amplite"])
        return dict(self.pending_state or {})

    def load_amplite_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`amplite_state`; before the first batch it waits for the prepare."""
        if not state:
            return
        if self.opt is None:
            self.pending_state = dict(state)
            return
        # the wrapped optimizer's own state is already loaded (by the framework): keep it, refresh the copies
        self.opt.load_state_dict({**self.opt.optimizer.state_dict(), "amplite": state})


@contextlib.contextmanager
def original_forward(module: nn.Module) -> Iterator[None]:
    """Take a patched ``forward`` off ``module`` for a while (``torch.export`` must trace the real one)."""
    patched = module.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if patched is not None:
            module.forward = patched


def patch_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Make ``module(...)`` call ``forward``; return the undo."""
    module.forward = forward

    def undo() -> None:
        module.__dict__.pop("forward", None)

    return undo


def patch_call(module: nn.Module, call: Callable[..., Any]) -> Callable[[], None]:
    """Make ``module(...)`` call ``call`` *before* the module's own hooks run; return the undo.

    For a ``fully_shard``-ed root: its pre-forward hook would gather the root's parameters (swapping them
    for the unsharded ones) before a patched ``forward`` could prepare, and the net runs the graph inside a
    root call of its own. So ``call`` runs outside, and any ``module(...)`` made while it runs (the net's,
    ``torch.export``'s) is the class's ordinary call, hooks included. Done as FSDP2 itself does, with a
    subclass made for this one instance.
    """
    cls = type(module)
    inside = [False]

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not module or inside[0]:
            return cls.__call__(self, *args, **kwargs)
        inside[0] = True
        try:
            return call(*args, **kwargs)
        finally:
            inside[0] = False

    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})

    def undo() -> None:
        if type(module).__bases__ == (cls,):
            module.__class__ = cls

    return undo
