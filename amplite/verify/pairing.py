"""Which node of the converted graph computes what which node of the reference computes.

:func:`pair_nodes` maps converted nodes to reference nodes (by name, op, module path and shape, then by
occurrence; a folded conv to its reference's BatchNorm output); :func:`is_view`, :func:`layer_of`,
:func:`decision_op` and :func:`folded_conv` are the node facts the shadow run (``shadow``) reads of a pair.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx

from amplite import op_tables
from amplite.ops.fp8_linear import fp8_linear
from amplite.passes.graph_utils import cast_dtype, module_path

_VIEWS: dict[Any, bool] = {}


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns an alias of its input (a view copies no values and adds no error)."""
    if node.target not in _VIEWS:
        schema = getattr(node.target, "_schema", None)
        _VIEWS[node.target] = bool(
            schema and schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable
        )
    return _VIEWS[node.target]


def layer_of(path: str) -> str:
    """The layer a module path belongs to: up to its first numbered part (``blocks.3``), else its top."""
    m = re.match(r"^(.*?\.\d+)(?:\.|$)", path)
    return m.group(1) if m else (path.split(".")[0] if path else "(root)")


def pair_nodes(ref: torch.fx.Graph, conv: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map converted nodes to reference nodes: by name, op, module path and shape first, then by
    (op, module path, occurrence).

    A name alone is not enough: re-export renumbers nodes when a pass removed some (fusion replaces
    ``linear`` nodes), so ``linear_4`` may be another module's linear in the converted graph. Amplite's own
    casts (pure dtype casts without a namesake in the reference) stay unpaired.
    """
    by_name = {n.name: n for n in ref.nodes}
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in conv.nodes:
        r = by_name.get(n.name)
        if r is None or r.op != n.op or not (r.target == n.target or n.op in ("placeholder", "get_attr")
                                             or _fp8_of(r, n)):
            continue
        if n.op == "call_function" and (module_path(r) != module_path(n) or not _same_shape(r, n)):
            continue
        pairs[n] = r
    taken = set(pairs.values())

    def key(n: torch.fx.Node) -> tuple[str, Any, str]:
        return (n.op, n.target if n.op != "placeholder" else None, module_path(n))

    pending: dict[tuple, list[torch.fx.Node]] = {}
    for n in ref.nodes:
        if n not in taken and n.op in ("call_function", "placeholder", "get_attr"):
            pending.setdefault(key(n), []).append(n)
    for n in conv.nodes:
        if n in pairs or n.op not in ("call_function", "placeholder", "get_attr") or cast_dtype(n) is not None:
            continue
        queue = pending.get(key(n))
        if queue:
            pairs[n] = queue.pop(0)
    _pair_folded_batchnorm(pairs)
    return pairs


def _fp8_of(ref: torch.fx.Node, conv: torch.fx.Node) -> bool:
    """Whether ``conv`` is the ``amplite::fp8_linear`` that ``--precision fp8`` made of the product ``ref``
    (it keeps the node's name)."""
    return conv.target is fp8_linear._opoverload and op_tables.op_name(ref.target) in op_tables.FP8_WEIGHT_OPS


aten = torch.ops.aten
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default}
#: The folded scale/shift as the converted program names them (``p_`` once lifted to a placeholder).
_FOLDED_ARG = re.compile(r"^(p_)?amplite_folded_\d+_(scale|shift)$")
_BNS = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}


def _bn_output(conv: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding the output of the inference BatchNorm that is ``conv``'s only user (or None)."""
    if conv.op != "call_function" or conv.target not in _CONVS or len(conv.users) != 1:
        return None
    bn = next(iter(conv.users))
    if bn.op != "call_function" or bn.target not in _BNS or bn.args[0] is not conv:
        return None
    if bn.target is aten.batch_norm.default:
        return bn
    first = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
    return first[0] if len(first) == 1 else None


def _pair_folded_batchnorm(pairs: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Pair a folded conv with its reference's conv+BatchNorm output, not the conv's pre-BN value.

    ``fold_batchnorm`` removed the BatchNorm: the converted conv computes what the reference's BN returns.
    A reference BN whose output no converted node pairs with was folded (with ``--no-fold-batchnorm`` the
    converted graph keeps its own BN, paired with the reference's, and nothing changes).
    """
    taken = set(pairs.values())
    for n, r in list(pairs.items()):
        if n.op == "call_function" and n.target in _CONVS:
            out = _bn_output(r)
            if out is not None and out not in taken and next(iter(r.users)) not in taken:
                end = _affine_end(n)  # O1 keeps the conv and adds the BN's affine after it: pair that with BN
                pairs[end if end is not None else n] = out


def _affine_end(conv: torch.fx.Node) -> torch.fx.Node | None:
    """The last of the ``mul``/``add`` by a folded scale/shift that ``fold_batchnorm`` put after ``conv``."""
    end, node = None, conv
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target not in (aten.mul.Tensor, aten.add.Tensor) or user.args[0] is not node:
            break
        arg = user.args[1]
        if not (isinstance(arg, torch.fx.Node) and _FOLDED_ARG.match(arg.name)):
            break
        end = node = user
    return end


def decision_op(n: torch.fx.Node) -> str | None:
    """The op name when ``n`` is a discrete decision or an output of one (``topk(...)[1]``), else None."""
    src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) else n
    name = op_tables.op_name(src.target)
    return name if name in op_tables.DISCRETE_DECISION_OPS else None


def folded_conv(n: torch.fx.Node, r: torch.fx.Node) -> torch.fx.Node | None:
    """The reference conv of a folded pair (``n`` a converted conv paired with a BN output), else None."""
    if n.target not in _CONVS or r.target in _CONVS:
        return None
    bn = r.args[0] if r.target is operator.getitem else r
    return bn.args[0] if isinstance(bn, torch.fx.Node) and isinstance(bn.args[0], torch.fx.Node) else None


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        try:
            return tuple(va.shape) == tuple(vb.shape)
        except (TypeError, RuntimeError):  # symbolic sizes: no verdict
            return True
    return True
