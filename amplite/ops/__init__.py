"""amplite's custom ops. Importing this package registers them with torch (``torch.ops.amplite.*``).

A ``.pt2`` that uses an amplite op loads with ``torch.export.load`` only after ``import amplite.ops``
(``import amplite`` does it).
"""

from amplite.ops.contract import active_backend, backend_description, contract

__all__ = ["active_backend", "backend_description", "contract"]
