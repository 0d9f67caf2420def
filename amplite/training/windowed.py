"""O2's low-precision copies under FSDP2: made inside each unit's gathered window and gone with it.

Under ``fully_shard`` a unit's full FP32 parameters exist only between FSDP's pre-forward gather and its
post-forward reshard (and again in backward, between the pre-backward gather and the post-backward
reshard). :class:`WindowedCopies` keeps O2's copies inside those windows:

- a copy is cast on first read inside the unit's part of the graph (:meth:`WindowedCopies.low_of`), from
  the gathered FP32 parameter, and the cache forgets it when the part ends (:meth:`release`);
- what autograd would save of a copy (the bf16 weight a matmul needs for its input gradient) is saved as
  a reference to the FP32 master instead (:meth:`saving_masters`): backward recasts it from the parameter
  FSDP has gathered again for that unit's backward (a checkpointed region recomputed there casts afresh
  too, outside any window, and nothing caches that copy). So no copy outlives its window: between forward and
  backward a sharded layer holds neither its FP32 nor its low-precision full weights, as under FSDP's own
  ``MixedPrecisionPolicy(param_dtype=...)``, at the cost of one cast per weight in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from amplite.training.lowcast import LowCopies


@dataclass(frozen=True)
class _Recast:
    """A saved low-precision view of ``master``: rebuilt by casting the master again in backward."""

    master: torch.Tensor
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def rebuild(self) -> torch.Tensor:
        with torch.no_grad():
            low = self.master.detach().to(self.dtype)
        return low.as_strided(self.size, self.stride, self.offset)


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 when it has none that can be named, e.g. a fake tensor)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class WindowedCopies(LowCopies):
    """:class:`LowCopies` whose copies live only inside a gathered window (FSDP2; always recast).

    Args:
        dtype: The low-precision dtype.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype, every_forward=True)
        self.casts = 0  # copies cast in forward windows (for tests and reports)
        self._window: dict[int, torch.Tensor] = {}  # storage address of a copy made in the open window -> master
        self.open = 0  # forward windows entered and not yet left (0 in backward)

    def low_of(self, master: torch.Tensor) -> torch.Tensor:
        """The copy of ``master`` for the open window (cast now from the gathered parameter if not yet)."""
        entry = self._copies.get(id(master))
        if entry is not None and entry[0] is master and entry[1] is not None:
            return entry[1]
        with torch.no_grad():
            low = master.detach().to(self.dtype)
        if not self.open:  # a checkpointed region recomputed in backward: a copy for that recompute only
            return low
        self._copies[id(master)] = (master, low, self._stamp(master))
        key = _storage(low)
        if key:
            self._window[key] = master
        self.casts += 1
        return low

    def sync(self) -> None:
        """Nothing before a forward: outside its window a master's storage is FSDP's (freed); copies are cast
        on first read inside the window."""

    def refresh(self, round_masters: bool = False) -> None:
        """Forget every copy (the next window recasts from the masters); O3's rounding is not offered here."""
        self.release()

    def after_step(self, round_masters: bool = False) -> None:
        """After an optimizer step: forget every copy."""
        self.release()

    def release(self) -> None:
        """End the window: the cache drops every copy (autograd holds masters, not copies)."""
        super().release()
        self._window.clear()

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(low copy, master)`` for the copies of the open window (none between windows)."""
        return [(low, master) for master, low, _ in self._copies.values() if low is not None]

    @contextlib.contextmanager
    def saving_masters(self) -> Iterator[None]:
        """While inside: autograd saves a reference to the master for any tensor viewing a window's copy."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._window or t.dtype is not self.dtype:
            return t
        master = self._window.get(_storage(t))
        if master is None:
            return t
        return _Recast(master, self.dtype, t.size(), t.stride(), t.storage_offset())


def _unpack(packed: Any) -> Any:
    return packed.rebuild() if isinstance(packed, _Recast) else packed
