"""torch.onnx's translation registry, built once per opset instead of on every export."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def cached_registry(opset: int, table: tuple[tuple[Any, Any], ...]) -> Any:
    """torch.onnx's registry of ATen translations plus ``table``, built once per opset and table.

    ``torch.onnx.export(dynamo=True)`` rebuilds this registry from torchlib on every call (about a second,
    often half of a small model's export); the exporter only reads it. Built as ``torch.onnx.export``
    builds it (``torch.onnx._internal.exporter._compat``: opsets below torchlib's are translated at
    torchlib's opset, then converted). None where those internals are not importable.
    """
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration  # noqa: F401
    except ImportError:
        return None
    registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
    for torch_op, onnx_op in table:
        registry.register_op(torch_op, onnx_op, is_complex=False)
    return registry
