"""The graph facts ``--precision fp8`` decides on, per matrix product (read by ``annotate_precision``).

Nothing here decides: :meth:`amplite.policy.PrecisionPolicy.for_fp8` does, from two strings this module
reads off the graph — why the op has no FP8 kernel (no stored 2-D weight operand, an op ``_scaled_mm``
cannot compute, a weight shared with a reader that stays in another dtype), and whether the calibrated
activation range would overflow e4m3 after scaling — and the :class:`~amplite.passes.meta.Fp8Site` the
``fp8_matmul`` pass rewrites the node from.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch.fx

from amplite import op_tables
from amplite.ops.fp8_numerics import E4M3_MAX
from amplite.passes.graph_utils import cast_dtype, fake_value
from amplite.passes.meta import Fp8Site
from amplite.passes.range_guard import ValueRange

#: e4m3's last step: 448 is its largest value and 480 the next one it would have. An activation whose
#: calibrated maximum exceeds ``448·scale`` by no more than that step is clipped by less than the format
#: rounds there; beyond it, saturation at 448 is an error rounding cannot explain: the layer stays low.
CLIP_SLACK = 480.0 / E4M3_MAX


def stored_weight(node: object) -> torch.fx.Node | None:
    """The ``get_attr`` an operand reads, through amplite's casts (None: not a stored tensor)."""
    while isinstance(node, torch.fx.Node) and cast_dtype(node) is not None:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def shared_weight(w: torch.fx.Node) -> bool:
    """Whether the tensor ``w`` reads is also read by something that cannot run in FP8 (an embedding tied to
    the LM head): an e4m3 copy would add its bytes beside the one kept for that reader."""
    gm = w.graph.owning_module
    if gm is None:
        return False
    tensor = operator.attrgetter(str(w.target))(gm)
    for reader in w.graph.find_nodes(op="get_attr"):
        if reader is not w and operator.attrgetter(str(reader.target))(gm) is not tensor:
            continue
        for user in reader.users:
            spec = op_tables.FP8_WEIGHT_OPS.get(op_tables.op_name(user.target) or "")
            if spec is None or len(user.args) <= spec[1] or stored_weight(user.args[spec[1]]) is not reader:
                return True
    return False


def fp8_fact(
    node: torch.fx.Node, ranges: Mapping[str, ValueRange] | None, clip_check: bool
) -> tuple[str, str, Fp8Site | None]:
    """``(no_kernel, overflow, site)`` of a compute-bound node under ``--precision fp8``.

    Args:
        node: A compute-bound op (``op_tables.LOW_PRECISION_OPS``) of the FP32 graph, before casts.
        ranges: Calibrated ranges by node name (static activation scales), or None (dynamic per token).
        clip_check: Apply the overflow rule (the range rules are on).

    Returns:
        Why the op has no FP8 kernel ('' when it has one), why its range keeps it out of e4m3 ('' when it
        fits; with the measured values), and the site to rewrite (None unless both are '').
    """
    op = op_tables.op_name(node.target) or str(node.target)
    spec = op_tables.FP8_WEIGHT_OPS.get(op)
    if spec is None:
        return f"no-fp8-kernel:{op.split('.')[0]}", "", None
    xi, wi, layout = spec
    if len(node.args) <= wi or any(k in node.kwargs for k in ("beta", "alpha")):
        return f"no-fp8-kernel:{op.split('.')[0]}-scaled", "", None
    x, w = node.args[xi], stored_weight(node.args[wi])
    xv, wv = fake_value(x), fake_value(w)
    if w is None or not isinstance(wv, torch.Tensor) or wv.dim() != 2 or not wv.dtype.is_floating_point:
        return "no-weight-operand", "", None
    if shared_weight(w):
        return "shared-weight", "", None
    if not isinstance(xv, torch.Tensor) or xv.dim() < 1 or not xv.dtype.is_floating_point:
        return "no-float-activation", "", None
    if op == "addmm.default" and (not isinstance(fake_value(node.args[0]), torch.Tensor)
                                  or fake_value(node.args[0]).dim() != 1):  # fmt: skip
        return "no-fp8-kernel:addmm-bias-shape", "", None
    if ranges is None:
        return "", "", Fp8Site(x=xi, w=wi, layout=layout, amax=None, w_amax=None)
    r = ranges.get(x.name) if isinstance(x, torch.fx.Node) else None
    if r is None:
        return "no-calibrated-range", "", None
    amax = r.percentile_abs if r.percentile_abs is not None else r.max_abs
    if clip_check and r.max_abs > amax * CLIP_SLACK:
        scale = amax / E4M3_MAX
        return "", f"fp8-range:overflow max|x|={r.max_abs:.4g} > 448·scale={E4M3_MAX * scale:.4g}", None
    chosen = r.fp8_amax if r.fp8_amax is not None else amax  # by measured error (converter.fp8_scales)
    own = ranges.get(node.name)
    w_amax = own.fp8_weight_amax if own is not None else None
    return "", "", Fp8Site(x=xi, w=wi, layout=layout, amax=float(chosen), w_amax=w_amax)
