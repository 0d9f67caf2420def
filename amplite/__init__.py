"""amplite: ahead-of-time mixed precision for PyTorch models, with proof.

``import amplite`` also registers amplite's custom ops (``amplite::contract``) so that converted
``.pt2`` files using them load with ``torch.export.load``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from amplite.converter.api import ConversionResult, convert  # noqa: E402
from amplite.errors import AmpliteError  # noqa: E402
from amplite.policy import Level, PrecisionPolicy  # noqa: E402

try:  # the custom-op package is optional until it lands; registering it must never break import
    import amplite.ops  # noqa: E402, F401
except ImportError:  # pragma: no cover
    pass

__all__ = ["AmpliteError", "ConversionResult", "Level", "PrecisionPolicy", "__version__", "convert"]
