"""Models that torch.export cannot trace, for the bad-input tests."""

from __future__ import annotations

import torch
from torch import nn


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: not traceable without torch.cond."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent branch
            return y * 2
        return y


def data_dependent() -> nn.Module:
    return DataDependent()


def not_a_module() -> object:
    return object()
