"""amplite: ahead-of-time mixed precision for PyTorch models, with proof.

``import amplite`` also registers amplite's custom ops (``amplite::contract``) so that converted
``.pt2`` files using them load with ``torch.export.load``.
"""

from __future__ import annotations

import amplite.ops  # noqa: F401  (registers amplite::contract for torch.export.load)
from amplite.api import ConversionResult, convert
from amplite.batch import BatchResult, JobResult, convert_many, iter_convert_many
from amplite.errors import AmpliteError
from amplite.gate import CheckResult, check
from amplite.options import ConvertOptions
from amplite.policy import Level, PrecisionPolicy
from amplite.spec import ConvertSpec
from amplite.training import prepare_training
from amplite.version import __version__

__all__ = [
    "AmpliteError",
    "BatchResult",
    "CheckResult",
    "ConversionResult",
    "ConvertOptions",
    "ConvertSpec",
    "JobResult",
    "Level",
    "PrecisionPolicy",
    "__version__",
    "check",
    "convert",
    "convert_many",
    "iter_convert_many",
    "prepare_training",
]
