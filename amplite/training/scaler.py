"""Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics, on FP32 master gradients.

The scale starts at 2**16; a step whose gradients hold an inf or NaN is skipped and the scale halves;
after 2000 clean steps in a row it doubles. The history (scale per step, skipped steps) feeds the reports.

Under FSDP2 each rank holds only its shard of every gradient (a ``DTensor``): an overflow lands in the
shards of the ranks that own those elements. The found-inf flag is therefore reduced (max) over the
masters' device meshes before anyone decides, so every rank skips or steps, and rescales, identically.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LossScaler:
    """The loss-scale state.

    Attributes:
        scale: The current loss scale.
        growth_factor: Multiplier after ``growth_interval`` clean steps.
        backoff_factor: Multiplier after a step with non-finite gradients.
        growth_interval: Clean steps in a row before the scale grows.
        growth_tracker: Clean steps since the last change.
        history: The scale used at each step, in order.
        skipped: Indices (into ``history``) of the steps that were skipped.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    history: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def unscale(
        self, grads: Iterable[torch.Tensor], groups: Sequence[Any] = (), device: torch.device | None = None
    ) -> bool:
        """Divide ``grads`` by the scale in place; return whether any of them holds an inf or NaN.

        Args:
            grads: The gradients (``DTensor`` shards are unscaled in their local tensors).
            groups: Process groups over which the verdict is reduced (:func:`shard_groups` of the masters):
                every rank of them must call this at the same step, with or without gradients.
            device: Where the flag lives when this rank has no gradient (the masters' device: NCCL reduces
                CUDA tensors only).
        """
        grads = [_local(g) for g in grads if g is not None]
        if not grads:
            return _any_rank(torch.zeros(1, device=device), groups)
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=grads[0].device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            f = found.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, f, inv.to(device))
            found += f.to(found.device)
        return _any_rank(found, groups)

    def update(self, found_inf: bool) -> None:
        """Record the step and adjust the scale (GradScaler's rule)."""
        self.history.append(self.scale)
        if found_inf:
            self.skipped.append(len(self.history) - 1)
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """The resumable state (the history is a report, not state, and is left out)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker"):
            setattr(self, key, type(getattr(self, key))(state[key]))


def shard_groups(params: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups of the device meshes the ``DTensor`` parameters among ``params`` are sharded over
    (one per mesh dimension; empty for plain tensors, e.g. under DDP, whose gradients are already equal)."""
    groups: list[Any] = []
    seen: set[int] = set()
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or id(mesh) in seen:
            continue
        seen.add(id(mesh))
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if all(group is not g for g in groups):
                groups.append(group)
    return groups


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` gradient's local shard (its storage: unscaling it unscales the gradient); else ``grad``."""
    local = getattr(grad, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else grad


def _any_rank(found: torch.Tensor, groups: Sequence[Any]) -> bool:
    """Whether ``found`` is non-zero on any rank of ``groups`` (a max all-reduce per group)."""
    if groups:
        import torch.distributed as dist

        for group in groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())
