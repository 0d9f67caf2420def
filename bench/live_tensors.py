"""The peak of live tensor bytes on the CPU: what ``torch.cuda.max_memory_allocated`` means on a GPU.

torch 2.13 keeps no allocator statistics for the CPU (``torch.cpu`` has no ``memory_stats``; the caching
allocator's counters are CUDA/XPU only), and the process's resident set also moves with the C allocator
keeping freed chunks and with one-off costs such as the first ``torch.export`` (its modules and caches).
:class:`LiveTensorPeak` counts tensor storages instead:

- on entry, every storage reachable from a live Python tensor (``gc``: parameters, gradients, optimizer
  state, batches, anything a library keeps between steps) is counted once;
- while active, a ``TorchDispatchMode`` sees every ATen op (forward, the autograd engine's backward ops,
  the optimizer's, recomputation under activation checkpointing) and counts each output storage that is
  new: not an input's storage (views and in-place results alias their input) and not counted already;
- a counted storage is uncounted when it is freed: storages keep their Python object for as long as the
  C++ storage lives (PyObject preservation), so a ``weakref.finalize`` on it fires exactly at the free,
  whoever held the last reference (autograd's saved tensors included).

``peak_bytes`` is the largest sum of counted ``nbytes`` at any moment since entry (or the last
:meth:`reset_peak`). What it does not see: memory allocated outside the dispatcher (inductor's compiled
kernels allocate their buffers directly, so compiled variants are not measured), a storage resized in
place after it was counted, and non-tensor memory (that is the resident set's business).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorPeak(TorchDispatchMode):
    """Context manager: the live and peak bytes of tensor storages (see the module docstring).

    Attributes:
        start_bytes: Bytes of the storages alive when it was entered.
        live_bytes: Bytes of the counted storages alive now.
        peak_bytes: The most ``live_bytes`` has been since entry or :meth:`reset_peak`.
        peak_op: The ATen op whose output reached ``peak_bytes`` ("" when the peak is the entry state).
    """

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, int] = {}  # id(storage object) -> nbytes, for the counted storages now alive
        self.start_bytes = self.live_bytes = self.peak_bytes = 0
        self.peak_op = ""

    def __enter__(self) -> LiveTensorPeak:
        for storage in _live_storages():
            self._count(storage)
        self.start_bytes = self.peak_bytes = self.live_bytes
        return super().__enter__()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes, self.peak_op = self.live_bytes, ""

    def _count(self, storage: torch.UntypedStorage) -> bool:
        key = id(storage)
        if key in self._alive:
            return False
        nbytes = storage.nbytes()
        self._alive[key] = nbytes
        self.live_bytes += nbytes
        weakref.finalize(storage, self._free, key)
        return True

    def _free(self, key: int) -> None:
        self.live_bytes -= self._alive.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        grew = False
        for t in tree_leaves(out):
            storage = _storage(t) if isinstance(t, torch.Tensor) else None
            if storage is not None and id(storage) not in inputs:
                grew |= self._count(storage)
        if grew and self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_op = self.live_bytes, str(func)
        return out


def live_bytes_now() -> int:
    """Bytes of the distinct storages of every live Python tensor (what :class:`LiveTensorPeak` starts from)."""
    return sum(s.nbytes() for s in _live_storages())


def _live_storages() -> list[torch.UntypedStorage]:
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        storage = _storage(obj) if isinstance(obj, torch.Tensor) else None
        if storage is not None:
            found.setdefault(id(storage), storage)
    return list(found.values())


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage when it holds memory (not a meta/fake tensor, not sparse or opaque)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:  # FakeTensors & co. hold no memory
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, mkldnn: no plain storage
        return None
    return storage if storage.device.type != "meta" else None
