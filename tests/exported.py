"""A model exported for the pass tests: eval mode, non-strict ``torch.export``, export checks stripped."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from amplite.converter.pipeline import strip_export_checks


def export_eval(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The exported GraphModule of ``model`` in eval mode on ``args``, without the export's shape asserts."""
    gm = torch.export.export(model.eval(), args, strict=False).module()
    strip_export_checks(gm)
    return gm


class Fn(nn.Module):
    """A module whose forward is ``fn``: a one-line model for a graph pattern."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)
