"""Inputs for a checkpoint's program, whose example inputs (and weights) are on the meta device: whether
inputs are, seeded random inputs shaped like the traced ones, and a tensor's size without its data."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram


def on_meta(inputs: Any) -> bool:
    """Whether any tensor of ``inputs`` is on the meta device (a traced example, not real data)."""
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


def random_inputs(program: ExportedProgram, vocab: int) -> tuple[tuple, dict[str, Any]]:
    """Seeded inputs shaped like the traced ones: token ids below ``vocab``, masks of ones, floats ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(0)

    def fake(name: str, t: torch.Tensor) -> torch.Tensor:
        if "mask" in name:
            return torch.ones(t.shape, dtype=t.dtype)
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=gen).to(t.dtype)
        return torch.randint(0, max(vocab, 1), t.shape, generator=gen, dtype=t.dtype)

    args, kwargs = program.example_inputs
    return tuple(fake(f"arg{i}", a) for i, a in enumerate(args)), {k: fake(k, v) for k, v in kwargs.items()}


def meta_bytes(program: ExportedProgram, name: str) -> int:
    """Bytes of the program's tensor ``name`` (0 when it has none by that name)."""
    t = program.state_dict.get(name, program.constants.get(name))
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
