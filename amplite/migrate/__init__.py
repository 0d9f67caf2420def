"""``amplite migrate``: libcst codemods moving training scripts onto native ``torch.amp``.

Three libcst codemod commands (``VisitorBasedCodemodCommand`` subclasses, each with a ``DESCRIPTION``):

* :class:`TorchAmpCommand`: ``torch.cuda.amp``/``torch.cpu.amp`` autocast, GradScaler and
  custom_fwd/custom_bwd to ``torch.amp`` with an explicit device.
* :class:`ApexAmpCommand`: NVIDIA apex ``amp`` to ``torch.amp.GradScaler`` + ``torch.autocast``.
* :class:`AddAutocastCommand`: mixed precision for a plain FP32 training loop.

:func:`migrate_source` and :func:`migrate_paths` run them in that order; see ``docs/migrate.md``.
"""

from amplite.migrate._pipeline import migrate_module
from amplite.migrate.add_autocast import AddAutocastCommand
from amplite.migrate.apex import ApexAmpCommand
from amplite.migrate.runner import FileResult, MigrateReport, format_report, migrate_paths, migrate_source
from amplite.migrate.torch_amp import TorchAmpCommand

__all__ = [
    "AddAutocastCommand",
    "ApexAmpCommand",
    "FileResult",
    "MigrateReport",
    "TorchAmpCommand",
    "format_report",
    "migrate_module",
    "migrate_paths",
    "migrate_source",
]
