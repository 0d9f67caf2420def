"""Per-node error of the layer-wise analysis: the :class:`NodeError` record and the :func:`node_error` measure.

Used by the shadow run (``shadow``) that fills the records and by ``layerwise``, which ranks and reports them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amplite.verify.compare import json_float


@dataclass
class NodeError:
    """Errors of one paired node.

    Attributes:
        index: Position in the converted graph (among recorded nodes).
        node: The node's name (the reference's, which the converted graph keeps).
        op: ATen op name. module: Dotted module path. source: ``file:line`` of the user's code.
        layer: The module path up to its last numbered component (``layers.3``), for per-layer charts.
        dtype: The dtype the converted node produces.
        accumulated: ``{sqnr_db, max_abs, rel_l2, new_nonfinite}`` on the converted model's own activations.
        isolated: The same, fed with the reference's inputs (None when the node could not be re-run).
        exact: The node received its operands in the reference's dtypes (isolated error 0 by construction).
        introduces_nonfinite: Its shadow output has NaN/Inf that its inputs did not bring.
        inherited_nonfinite: Its inputs already carried NaN/Inf from a producer's low-precision output.
        range: Range statistics of the reference value in the target dtype (see ``ranges``).
    """

    index: int
    node: str
    op: str
    module: str
    source: str
    layer: str
    dtype: str | None
    accumulated: dict[str, Any] | None = None
    isolated: dict[str, Any] | None = None
    exact: bool = False
    introduces_nonfinite: bool = False
    inherited_nonfinite: bool = False
    range: dict[str, Any] | None = None

    def rank_key(self) -> tuple[int, float]:
        """Sort key: introduced NaN/Inf first, then lowest isolated SQNR."""
        sqnr = self.isolated["sqnr_db"] if self.isolated else math.inf
        return (0 if self.introduces_nonfinite else 1, sqnr)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return pytree.tree_map(json_float, asdict(self))


def node_error(ref: Any, out: Any) -> dict[str, Any] | None:
    """SQNR, max |error|, relative L2 error and new NaN/Inf of ``out`` against ``ref`` (None if not comparable).

    Computed in FP32 (no copy of an FP32 reference); a non-finite norm (NaN/Inf, or FP32 overflow) sends it
    down the slow path, in FP64 over the finite elements.
    """
    if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)) or ref.shape != out.shape:
        return None
    if not ref.dtype.is_floating_point or ref.numel() == 0:
        return None
    r, o = ref.detach(), out.detach()
    if r.dtype != torch.float32:
        r = r.float()
    # The subtraction promotes a low-precision output itself (no FP32 copy of it first).
    d = o - r if o.dtype in (torch.float16, torch.bfloat16, torch.float32) else o.float() - r
    new_nonfinite = 0
    lo, hi = torch.aminmax(d)  # max |d| without a |d| tensor (aminmax is also faster than max() on CPU)
    rn, en, mx = torch.stack([r.norm(), d.norm(), torch.maximum(-lo, hi)]).tolist()
    if not (math.isfinite(rn) and math.isfinite(en)):  # NaN/Inf somewhere (inf - inf is NaN), or huge values
        rf, of = torch.isfinite(r), torch.isfinite(o)
        new_nonfinite = int((rf & ~of).sum())
        r, o = r[rf & of].double(), o[rf & of].double()
        if r.numel() == 0:
            return {"sqnr_db": -math.inf, "max_abs": math.inf, "rel_l2": math.inf, "new_nonfinite": new_nonfinite}
        d = o - r
        rn, en, mx = torch.stack([r.norm(), d.norm(), d.abs().max()]).tolist()
    if new_nonfinite:
        sqnr, rel = -math.inf, math.inf
    else:
        sqnr = math.inf if en == 0 else (20 * math.log10(rn / en) if rn > 0 else -math.inf)
        rel = en / rn if rn > 0 else (0.0 if en == 0 else math.inf)
    return {"sqnr_db": sqnr, "max_abs": mx, "rel_l2": rel, "new_nonfinite": new_nonfinite}
