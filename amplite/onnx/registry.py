"""torch.onnx's translation registry, built once per opset instead of on every export."""

from __future__ import annotations

import functools
import inspect
from typing import Any

#: The keywords :func:`amplite.onnx.export.export_model` passes to the exporter's internal ``_core.export``.
CORE_KEYWORDS = ("registry", "optimize", "verbose", "report", "opset_version")


@functools.lru_cache(maxsize=8)
def cached_registry(opset: int, table: tuple[tuple[Any, Any], ...]) -> Any:
    """torch.onnx's registry of ATen translations plus ``table``, built once per opset and table.

    ``torch.onnx.export(dynamo=True)`` rebuilds this registry from torchlib on every call (about a second,
    often half of a small model's export); the exporter only reads it. Built as ``torch.onnx.export``
    builds it (``torch.onnx._internal.exporter._compat``: opsets below torchlib's are translated at
    torchlib's opset, then converted). None where those internals moved (not importable, or ``_core.export``
    no longer takes the keywords amplite passes): the caller then uses the public ``torch.onnx.export``.
    """
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration

        params = inspect.signature(_core.export).parameters
        if not all(k in params for k in CORE_KEYWORDS):
            return None
        registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
        for torch_op, onnx_op in table:
            registry.register_op(torch_op, onnx_op, is_complex=False)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return registry
