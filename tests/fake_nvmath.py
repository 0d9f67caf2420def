"""Install a fake nvmath-python 1.0.0 (cuTENSOR 2.3.1) so the cuTENSOR backend's logic runs on CPU."""

from __future__ import annotations

import sys
import types

import pytest

from amplite.ops import cutensor_backend as cb


def install(monkeypatch: pytest.MonkeyPatch, contraction: type) -> types.ModuleType:
    """Make ``import nvmath`` give a module whose ``tensor.BinaryContraction`` is ``contraction``.

    The probe may run on CPU tensors, pointer alignment is pinned to 256, the backend choice comes from no
    environment variable, and the probe verdicts and plan cache start empty.
    """
    mod = types.ModuleType("nvmath")
    mod.tensor = types.SimpleNamespace(BinaryContraction=contraction)
    mod.bindings = types.SimpleNamespace(cutensor=types.SimpleNamespace(get_version=lambda: 20301))
    monkeypatch.setitem(sys.modules, "nvmath", mod)
    monkeypatch.setattr(cb, "nvmath_version", lambda: "1.0.0")
    monkeypatch.setattr(cb, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(cb, "_alignment", lambda t: 256)
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    cb.reset_probes()
    cb.clear_cache()
    return mod
