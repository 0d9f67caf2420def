"""Model factories that fail on purpose: ``--model-factory tests.batch_models.broken:NAME``.

Each model has a small linear layer (so its state dict is not empty) and takes ``x`` of shape 4x8.
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch import nn

#: The input spec every model here takes.
INPUTS = ["x:4x8:float32"]


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class DataDependent(_Base):
    """Python control flow on a tensor value: torch.export cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            return y * 2
        return y


class Hang(_Base):
    """Never returns (sleeps far past any test timeout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(600)
        return self.fc(x)


class Segfault(_Base):
    """Dereferences a null pointer: the process dies with SIGSEGV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctypes.string_at(0)
        return self.fc(x)


class MemoryHog(_Base):
    """Asks for 8 GiB (never touched): fails under a worker memory limit below that.

    Without the limit the allocation succeeds lazily; it is then dropped and an error raised, so that a
    missing limit shows as a wrong status rather than as memory actually used.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        waste = torch.empty(2**31)
        del waste
        raise RuntimeError("the 8 GiB allocation succeeded: no memory limit was in force")


def data_dependent() -> nn.Module:
    return DataDependent()


def hang() -> nn.Module:
    return Hang()


def segfault() -> nn.Module:
    return Segfault()


def memory_hog() -> nn.Module:
    return MemoryHog()


def write_state_dict(factory: str, path) -> None:
    """Save the state dict of ``factory``'s model (seeded) to ``path``."""
    torch.manual_seed(0)
    torch.save(globals()[factory]().state_dict(), path)
