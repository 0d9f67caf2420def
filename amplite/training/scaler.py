"""Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics, on FP32 master gradients.

The scale starts at 2**16; a step whose gradients hold an inf or NaN is skipped and the scale halves;
after 2000 clean steps in a row it doubles. The history (scale per step, skipped steps) feeds the reports.
"""

from __future__ import annotations

from collections.abc import Iterable
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

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; return whether any of them holds an inf or NaN."""
        grads = [g for g in grads if g is not None]
        if not grads:
            return False
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=grads[0].device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            f = found.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, f, inv.to(device))
            found += f.to(found.device)
        return bool(found.item())

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
