"""A model whose output is a custom class registered as a pytree node on import (like transformers' ModelOutput).

A .pt2 of it loads only in a process that imported this module: the ``--import`` tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn


@dataclass
class Pair:
    """Two output tensors."""

    first: torch.Tensor
    second: torch.Tensor


pytree.register_dataclass(Pair, serialized_type_name=f"{__name__}.Pair")


class TwoHeads(nn.Module):
    """Returns a :class:`Pair`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(self.a(x), self.b(x).relu())
