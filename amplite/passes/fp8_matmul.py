"""Pass: run the matrix products the plan put in FP8 as ``amplite::fp8_linear`` (``--precision fp8``).

Reads ``meta[FP8_KEY]`` (an :class:`~amplite.passes.meta.Fp8Site`, written by ``annotate_precision`` from
:meth:`amplite.policy.PrecisionPolicy.for_fp8`): this pass decides nothing. It runs after ``insert_casts``
(the activation already arrives in bf16) and before ``store_low_params``.

Guarantees afterwards: every node with an FP8 site computes ``fp8_linear(x, w_e4m3, w_scale, x_scale, bias)``
with its name, module stack and output (dtype and shape) unchanged, and its plan entry's dtype is
``float8_e4m3fn``. Weights are quantized once per tensor, per output channel (scale = amax/448, FP32,
:mod:`amplite.ops.fp8_numerics`; with calibration data, each channel's amax as ``converter.fp8_scales``
chose it by the measured output error); a weight every reader of which runs in FP8 is replaced by its e4m3 copy
under its own name (its FP32 tensor leaves the program: the ``.pt2`` shrinks), with its scales beside it as
``<name>_scale``; a weight something else also reads (an embedding tied to the LM head) keeps its tensor
and the FP8 copy is added. Static activation scales are FP32 scalars ``amplite_fp8_input_scale_<node>``.
New tensors only: the module shares storage with the user's model.

Counters: ``fp8_nodes``, ``weights_fp8``, ``weight_scales_measured`` (weights whose per-channel scales
calibration chose), ``bytes_saved``, and ``kept_low:<reason>`` for each compute-bound
node the plan kept in the low dtype (no FP8 kernel, an overflowing range, a pin), by reason.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch import nn

from amplite import op_tables
from amplite.ops.fp8_linear import fp8_linear
from amplite.ops.fp8_numerics import FP8_DTYPE, quantize_weight, scale_from_amax
from amplite.passes.base import PassBase, PassResult
from amplite.passes.fp8_sites import stored_weight
from amplite.passes.graph_utils import cast_dtype, fake_value, static_fake
from amplite.passes.meta import FP8_KEY, PRECISION_KEY, Fp8Site
from amplite.passes.store_low_params import _aliases, _owner

aten = torch.ops.aten
_COMPUTE_BOUND = frozenset(op_tables.LOW_PRECISION_OPS)


def _final_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s readers, looking through amplite's casts."""
    out: list[torch.fx.Node] = []
    for u in node.users:
        out += _final_users(u) if cast_dtype(u) is not None else [u]
    return out


def _free_name(module: nn.Module, name: str) -> str:
    base, i = name, 1
    while hasattr(module, name):
        name, i = f"{base}_{i}", i + 1
    return name


class Fp8Matmul(PassBase):
    """Rewrite FP8-planned matrix products into ``amplite::fp8_linear`` with e4m3 weights."""

    name = "fp8_matmul"

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """The plan is made (it marks the FP8 sites)."""
        self.require_planned(gm)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """No FP8 site is left unrewritten, and every ``fp8_linear`` is planned in ``float8_e4m3fn``."""
        for n in gm.graph.nodes:
            if FP8_KEY in n.meta:
                raise self.broken(f"node {n.name} is an FP8 site that was not rewritten")
            planned = (n.meta.get(PRECISION_KEY) or {}).get("dtype")
            if n.op == "call_function" and n.target is fp8_linear._opoverload and planned != FP8_DTYPE:
                raise self.broken(f"fp8_linear {n.name} is not planned in {FP8_DTYPE}")

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        counters: Counter[str] = Counter()
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and FP8_KEY in n.meta]
        for n in gm.graph.nodes:
            plan = n.meta.get(PRECISION_KEY)
            low = plan is not None and plan["mode"] == "low"
            if FP8_KEY not in n.meta and low and op_tables.op_name(n.target) in _COMPUTE_BOUND:
                counters[f"kept_low:{plan['reason'].split(' ')[0]}"] += 1
        if not nodes:
            return PassResult(gm, False, counters)
        mode = next((v.fake_mode for v in (fake_value(n) for n in nodes) if hasattr(v, "fake_mode")), None)
        aliases = _aliases(gm)
        done: dict[tuple[int, str], tuple[torch.fx.Node | str, str]] = {}  # (tensor, layout) -> (weight, scale)
        for node in nodes:
            site: Fp8Site = node.meta.pop(FP8_KEY)
            src = stored_weight(node.args[site["w"]])
            assert src is not None  # fp8_fact checked it
            owner, attr = _owner(gm, str(src.target))
            tensor = getattr(owner, attr)
            key = (id(tensor), site["layout"])
            if key not in done:
                done[key] = self._store(gm, node, src, tensor, site, aliases, counters)
                # stored in place, the attribute now holds the e4m3 tensor: the next reader must find it done,
                # not quantize the e4m3 values again (a second scale, the weight counted twice)
                done[(id(getattr(owner, attr)), site["layout"])] = done[key]
            weight, scale_name = done[key]
            with gm.graph.inserting_before(node):
                w_node = weight if isinstance(weight, torch.fx.Node) else self._get_attr(gm, weight, mode)
                if site["layout"] == "kn":  # stored [in, out]: the op takes [out, in]
                    w_t = gm.graph.call_function(aten.t.default, (w_node,))
                    w_t.meta["val"] = fake_value(w_node).t()
                    w_node = w_t
                s_node = self._get_attr(gm, scale_name, mode)
                x_node = None
                if site["amax"] is not None:
                    x_name = _free_name(gm, f"amplite_fp8_input_scale_{node.name}")
                    gm.register_buffer(x_name, scale_from_amax(site["amax"]).reshape(()))
                    x_node = self._get_attr(gm, x_name, mode)
            bias = self._bias(node)
            old = list(node.all_input_nodes)
            node.target = fp8_linear._opoverload
            node.args = (node.args[site["x"]], w_node, s_node, x_node, bias)
            node.kwargs = {}
            node.meta[PRECISION_KEY] = {**node.meta[PRECISION_KEY], "dtype": FP8_DTYPE}
            self._drop_dead(gm, old)
            counters["fp8_nodes"] += 1
        return PassResult(gm, True, counters)

    @staticmethod
    def _bias(node: torch.fx.Node) -> Any:
        op = op_tables.op_name(node.target)
        if op == "linear.default":
            return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0] if op == "addmm.default" else None

    def _store(
        self,
        gm: torch.fx.GraphModule,
        node: torch.fx.Node,
        src: torch.fx.Node,
        tensor: torch.Tensor,
        site: Fp8Site,
        aliases: dict[int, list[tuple[nn.Module, str]]],
        counters: Counter[str],
    ) -> tuple[torch.fx.Node | str, str]:
        """Quantize ``tensor`` once; returns its e4m3 weight (the reused ``get_attr`` node when replaced in
        place, else a new attribute's name) and its scale attribute's name. Per output channel, the scale
        maps the site's calibrated ``w_amax`` onto 448 where calibration chose one (the first product
        reading the tensor decides), else the channel's maximum."""
        layout, w_amax = site["layout"], site.get("w_amax")
        w32 = tensor.detach().float()
        w_nk = w32 if layout == "nk" else w32.t()
        if w_amax is None:
            q, scale = quantize_weight(w_nk, per_channel=True)
        else:
            q, scale = quantize_weight(w_nk, True, w_amax)
            counters["weight_scales_measured"] += 1
        q = q if layout == "nk" else q.t().contiguous()  # stored in the tensor's own layout
        scale = scale.reshape(-1)
        readers = [n for n in gm.graph.nodes if n.op == "get_attr" and _holds(gm, n, tensor)]
        users = [u for r in readers for u in _final_users(r)]
        in_place = all(
            FP8_KEY in u.meta and u.meta[FP8_KEY]["layout"] == layout and stored_weight(u.args[u.meta[FP8_KEY]["w"]])
            in readers for u in users if u is not node
        )  # fmt: skip
        counters["weights_fp8"] += 1
        if in_place and len(readers) == 1:
            stored: torch.Tensor = nn.Parameter(q, requires_grad=False) if isinstance(tensor, nn.Parameter) else q
            for owner, attr in aliases.get(id(tensor), [_owner(gm, str(src.target))]):
                store = "_parameters" if attr in getattr(owner, "_parameters", {}) else "_buffers"
                if attr in getattr(owner, store, {}):
                    getattr(owner, store)[attr] = stored
                else:
                    setattr(owner, attr, stored)
            src.meta["val"] = static_fake(fake_value(src).fake_mode, q)
            owner, attr = _owner(gm, str(src.target))
            scale_attr = _free_name(owner, f"{attr}_scale")
            owner.register_buffer(scale_attr, scale)
            counters["bytes_saved"] += tensor.nbytes - q.nbytes
            prefix = str(src.target).rpartition(".")[0]
            return src, f"{prefix}.{scale_attr}" if prefix else scale_attr
        base = _free_name(gm, "amplite_fp8_" + re.sub(r"[^a-zA-Z0-9]", "_", str(src.target)))
        gm.register_buffer(base, q)
        gm.register_buffer(base + "_scale", scale)
        return base, base + "_scale"

    @staticmethod
    def _get_attr(gm: torch.fx.GraphModule, target: str, mode: Any) -> torch.fx.Node:
        node = gm.graph.get_attr(target)
        node.meta["val"] = static_fake(mode, operator.attrgetter(target)(gm))
        return node

    @staticmethod
    def _drop_dead(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
        """Erase the casts and weight reads the rewrite left without readers (never a graph input)."""
        frontier, erased = list(nodes), set()
        while frontier:
            n = frontier.pop()
            if n not in erased and not n.users and (cast_dtype(n) is not None or n.op == "get_attr"):
                frontier += list(n.all_input_nodes)
                gm.graph.erase_node(n)
                erased.add(n)


def _holds(gm: torch.fx.GraphModule, node: torch.fx.Node, tensor: torch.Tensor) -> bool:
    try:
        return operator.attrgetter(str(node.target))(gm) is tensor
    except AttributeError:
        return False
