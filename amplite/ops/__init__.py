"""amplite's custom ops. Importing this package registers them with torch (``torch.ops.amplite.*``).

A ``.pt2`` that uses an amplite op loads with ``torch.export.load`` only after ``import amplite.ops``
(``import amplite`` does it): ``amplite::contract`` (fused contractions) and ``amplite::fp8_linear``
(``--precision fp8``).
"""

from amplite.ops.contract import active_backend, backend_description, contract
from amplite.ops.fp8_linear import fp8_linear

__all__ = ["active_backend", "backend_description", "contract", "fp8_linear"]
