"""BatchNorm with ``momentum=None`` (a cumulative moving average of the batch statistics) in a traced graph.

``nn.BatchNorm*`` computes that average's factor as ``1 / float(num_batches_tracked)``: a Python float read
from a tensor, which ``torch.export`` cannot trace (a data-dependent value) and which would be baked in as
one number if it could. Such modules are traced with ``momentum=1.0`` instead (the op then writes the batch
statistics into the running buffers) and :class:`CumulativeStats` blends them around each train-graph call
exactly as the module would: ``running = (1 - f) * before + f * batch`` with ``f = 1 / num_batches_tracked``
(the graph has already counted this batch). The eval graph reads the running statistics and needs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def cumulative_batchnorms(model: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm modules of ``model`` that keep a cumulative average (``momentum=None``)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, _BatchNorm) and m.momentum is None and m.track_running_stats and m.running_mean is not None
    ]


@contextlib.contextmanager
def traceable_momentum(model: nn.Module) -> Iterator[None]:
    """While inside, ``momentum=None`` BatchNorms have ``momentum=1.0`` (see the module docstring)."""
    found = cumulative_batchnorms(model)
    for m in found:
        m.momentum = 1.0
    try:
        yield
    finally:
        for m in found:
            m.momentum = None


class CumulativeStats:
    """Blend the running statistics of ``momentum=None`` BatchNorms around a train-graph call.

    Args:
        model: The user's model.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = cumulative_batchnorms(model)

    @torch.no_grad()
    def before(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The running statistics before the graph overwrites them with the batch's."""
        return [(m.running_mean.clone(), m.running_var.clone()) for m in self.modules]  # type: ignore[union-attr]

    @torch.no_grad()
    def after(self, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``running = (1 - f) * before + f * batch``, ``f = 1 / num_batches_tracked``."""
        for m, (mean, var) in zip(self.modules, saved, strict=True):
            f = 1.0 / float(m.num_batches_tracked)  # type: ignore[arg-type]
            m.running_mean.mul_(f).add_(mean, alpha=1.0 - f)  # type: ignore[union-attr]
            m.running_var.mul_(f).add_(var, alpha=1.0 - f)  # type: ignore[union-attr]


__all__ = ["CumulativeStats", "cumulative_batchnorms", "traceable_momentum"]
