"""FuseContractions' decisions on small exported graphs: what it fuses, where a chain stops and why."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
from torch import nn

import amplite.ops  # noqa: F401  (registers amplite::contract)
from amplite.passes.fuse_contractions import FuseContractions
from amplite.passes.meta import CONTRACT_KEY

aten = torch.ops.aten


CONTRACT = torch.ops.amplite.contract.default


ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _h(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).half()


_EXPORTED: dict[tuple[str, str], torch.export.ExportedProgram] = {}


def _module(model: nn.Module, kind: str, args: tuple) -> torch.fx.GraphModule:
    """A fresh exported GraphModule of ``model`` (kind ``kind``); the export itself is done once, at import
    (see the end of this file), so that each test costs milliseconds and runs within the mutant budget."""
    key = (type(model).__name__, kind)
    if key not in _EXPORTED:
        _EXPORTED[key] = torch.export.export(model, args, strict=False)
    return _EXPORTED[key].module()


class _AfterMatmul(nn.Module):
    """``a @ b.t()`` (fp16, 4x5) followed by one of the neighbours the pass must stop at and record."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ab = a @ b.t()
        k = self.kind
        if k == "second_bias":
            return ab + c + c
        if k == "cast_then_bias":
            return ab.float() + c.float()
        if k == "cast":
            return ab.float()
        if k == "cast_then_relu":
            return torch.relu(ab.float())
        if k == "bias_dtype":
            return ab + c.float()
        if k == "tensor_scale":
            return ab * c
        if k == "number_add":
            return ab + 1.5
        if k == "self_add":
            return ab + ab
        if k == "sub_from":
            return c - ab
        return ab  # "plain": the contraction result is the graph output


# (kind, rejection records, whether an add/sub/mul stays after the contract). The details are the ones
# ``_note_output_stop`` writes: "<node>: bias <other operand, or ? when both operands are the contraction>
# not absorbed", the dtypes of a bias_dtype mismatch, and for an output cast what the contract returns and
# the add after the cast that is therefore not absorbed.
_STOPS = [
    ("second_bias", [("add_1", "second_bias", "add_1: bias c not absorbed")]),
    ("cast_then_bias", [("to", "output_cast",
                         "contract returns torch.float16; the torch.float32 bias add add after it is not absorbed")]),
    ("cast", [("to", "output_cast", "contract returns torch.float16")]),
    ("cast_then_relu", [("to", "output_cast", "contract returns torch.float16")]),  # no bias add after the cast
    ("bias_dtype", [("add", "bias_dtype", "add: bias to not absorbed (torch.float32 vs torch.float16)")]),
    ("tensor_scale", [("mul", "tensor_scale", "scaling by a tensor is not absorbed")]),
    ("number_add", [("add", "bias_not_tensor", "add: bias 1.5 not absorbed")]),
    ("self_add", [("add", "bias_not_tensor", "add: bias ? not absorbed")]),
    ("sub_from", [("sub", "bias_not_tensor", "sub: bias c not absorbed")]),
    ("plain", []),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "want"), _STOPS, ids=[s[0] for s in _STOPS])
def test_output_chain_stop_is_recorded_with_its_reason_and_detail(kind: str, want: list[tuple[str, str, str]]) -> None:
    """Where the output chain stops, the report names the node, the reason and what was not absorbed."""
    args = (_h(4, 6), _h(5, 6), _h(4, 5))
    gm = _module(_AfterMatmul(kind), kind, args)
    ref = gm(*args)
    res = FuseContractions()(gm)
    got = [asdict(r) for r in res.rejections]
    assert got == [{"node": n, "rule": "matmul", "reason": r, "detail": d} for n, r, d in want], got
    counters = {k: v for k, v in res.counters.items() if v}
    expected = {"fused:matmul": 1, "absorbed:transpose": 1, "absorbed:bias": int(kind == "second_bias")}
    expected.update({f"rejected:{r}": 1 for _, r, _ in want})
    assert counters == {k: v for k, v in expected.items() if v}, counters
    torch.testing.assert_close(gm(*args).float(), ref.float(), rtol=3e-3, atol=3e-3)


class _Inner(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (a.transpose(0, 1).contiguous() @ b.permute(1, 0)) * 0.5 + c


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.inner(a, b, c)


def test_replacement_is_one_contract_with_the_original_provenance_and_records() -> None:
    """0.5 * (a^T b^T) + c becomes contract('ab,ca->bc', a, b, c, alpha=0.5, beta=1): no other node left.

    The contract keeps the matmul's module path and stack trace (the report and per-module overrides read
    them), names what it absorbed operand chain first (source to consumer), then the output tail, and the
    counters count each absorbed node by kind.
    """
    args = (torch.randn(6, 4), torch.randn(5, 6), torch.randn(4, 5))
    gm = _module(_Outer(), "", args)
    ref = gm(*args)
    mm = next(n for n in gm.graph.nodes if n.target is aten.matmul.default)
    provenance = {k: mm.meta[k] for k in ("nn_module_stack", "stack_trace")}
    assert "_Inner" in str(provenance["nn_module_stack"]) and provenance["stack_trace"]
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [CONTRACT], gm.graph  # every absorbed node is erased
    (fused,) = calls
    a, b, c = (n for n in gm.graph.nodes if n.op == "placeholder")
    assert fused.args == ("ab,ca->bc", a, b, c, 0.5, 1.0)
    assert {k: fused.meta[k] for k in provenance} == provenance
    absorbed = ["transpose", "contiguous", "permute", "mul", "add"]
    assert fused.meta[CONTRACT_KEY] == {"rule": "matmul", "absorbed": absorbed}
    assert list(fused.meta["val"].shape) == [4, 5] and fused.meta["val"].dtype == torch.float32
    assert res.details == {
        "fused": [{"node": fused.name, "rule": "matmul", "equation": "ab,ca->bc", "absorbed": absorbed}],
        "rejected": [],
    }
    assert res.counters.items() >= {
        "fused:matmul": 1, "absorbed:transpose": 1, "absorbed:contiguous": 1, "absorbed:permute": 1,
        "absorbed:scale": 1, "absorbed:bias": 1,
    }.items()  # fmt: skip
    assert res.modified
    torch.testing.assert_close(gm(*args), ref, rtol=1e-5, atol=1e-5)


def test_no_bias_means_beta_zero_and_a_cast_in_the_chain_keeps_the_export_check_on_the_source() -> None:
    """a.t().half() @ b: the cast is applied to ``a`` itself, the transpose is erased, and export's dtype
    check that read the transpose now reads ``a``; with no bias the contract's beta is 0."""
    args = (torch.randn(6, 4), _h(6, 5))
    gm = _module(_Fn2(), "", args)
    ref = gm(*args)
    res = FuseContractions()(gm)
    gm.graph.lint()
    a = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (check,) = [n for n in gm.graph.nodes if n.target is aten._assert_tensor_metadata.default]
    assert check.args[0] is a
    assert aten.t.default not in {n.target for n in gm.graph.nodes}
    (fused,) = [n for n in gm.graph.nodes if n.target is CONTRACT]
    assert fused.args[3] is None and fused.args[4:] == (1.0, 0.0), fused.args
    assert fused.args[1].args[0] is a and fused.args[1].meta["val"].dtype == torch.float16
    assert res.fused[0].absorbed == ["t", "to"]
    assert res.counters.items() >= {
        "fused:matmul": 1,
        "absorbed:transpose": 1,
        "absorbed:cast": 1,
    }.items()
    torch.testing.assert_close(gm(*args), ref, rtol=2e-3, atol=2e-3)


class _Fn2(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.t().half() @ b


class _Fn(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "expand":
            return a.expand(3, 4) @ b
        if k == "merge_a":
            return a.reshape(6, 4) @ b
        if k == "merge_k":
            return a.reshape(2, 12) @ b
        if k == "clone":
            return a.clone() @ b
        if k == "scale":
            return (a * 2.0) @ b
        if k == "two":
            return (a @ b) @ b.t()
        return a @ b


_NOTHING = "nothing_to_absorb"


_NONE_FREE = "0 free view(s) absorbed, 0 new view(s) needed"


# (kind, a shape, b shape, dtypes, rejections as (node, reason, detail), counters of a fused result).
_PLANS = [
    # FP32 is left alone by default; the detail names the dtype.
    ("plain", (3, 4), (4, 5), None, [("matmul", "dtype_not_enabled", "torch.float32")], {}),
    # Two rejections for one reason count 2.
    ("two", (3, 4), (4, 5), None, [("matmul", "dtype_not_enabled", "torch.float32"),
                                   ("matmul_1", "dtype_not_enabled", "torch.float32")], {}),
    # A bare matmul absorbs nothing: not replaced (cuBLAS runs it as well).
    ("plain", (3, 4), (4, 5), ALL_FLOATS, [("matmul", _NOTHING, _NONE_FREE)], {}),
    # Only an expand gives output mode 3: the retry keeps it as the source, then nothing is left to absorb.
    ("expand", (1, 4), (4, 5), ALL_FLOATS, [("expand", "broadcast_only_mode", "not absorbed into matmul"),
                                             ("matmul", _NOTHING, _NONE_FREE)], {}),
    # A merge of a's leading dims is absorbed (the result is viewed back): one free view saved.
    ("merge_a", (2, 3, 4), (4, 5), ALL_FLOATS, [], {"fused:matmul": 1, "absorbed:view": 1}),
    # A merge of the contracted dims needs a split view of b: one view saved, one added, so no gain.
    ("merge_k", (2, 3, 4), (12, 5), ALL_FLOATS,
     [("matmul", _NOTHING, "1 free view(s) absorbed, 1 new view(s) needed")], {}),
    # A clone or a scaling is a kernel eager runs: absorbing it always pays.
    ("clone", (3, 4), (4, 5), ALL_FLOATS, [], {"fused:matmul": 1, "absorbed:contiguous": 1}),
    ("scale", (3, 4), (4, 5), ALL_FLOATS, [], {"fused:matmul": 1, "absorbed:scale": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "sa", "sb", "dtypes", "want", "fused"), _PLANS)
def test_plan_gain_decides_and_explains_what_is_fused(
    kind: str, sa: tuple, sb: tuple, dtypes: tuple | None, want: list, fused: dict
) -> None:
    """Whether a contraction is replaced follows its gain (kernels saved, views saved net of new ones), and
    each decision not to fuse reaches the report with its reason and detail."""
    args = (torch.randn(sa), torch.randn(sb))
    gm = _module(_Fn(kind), kind, args)
    ref = gm(*args)
    res = FuseContractions() if dtypes is None else FuseContractions(dtypes=dtypes)
    out = res(gm)
    got = [asdict(r) for r in out.rejections]
    assert got == [{"node": n, "rule": "matmul", "reason": r, "detail": d} for n, r, d in want], got
    counters = {k: v for k, v in out.counters.items() if v}
    want_counters = dict(fused)
    for _, r, _ in want:
        key = f"skipped:{r}" if r == _NOTHING else f"rejected:{r}"
        want_counters[key] = want_counters.get(key, 0) + 1
    assert counters == want_counters, counters
    assert out.modified == bool(fused)
    assert (CONTRACT in {n.target for n in gm.graph.nodes}) == bool(fused)
    torch.testing.assert_close(gm(*args), ref, rtol=1e-5, atol=1e-5)


def test_fuse_plain_replaces_a_contraction_that_absorbs_nothing() -> None:
    """fuse_plain=True: a bare matmul becomes a contract all the same, with nothing absorbed."""
    args = (torch.randn(3, 4), torch.randn(4, 5))
    gm = _module(_Fn("plain"), "plain", args)
    res = FuseContractions(dtypes=ALL_FLOATS, fuse_plain=True)(gm)
    assert res.rejections == [] and res.counters.items() >= {"fused:matmul": 1}.items()
    assert [asdict(f) for f in res.fused] == [
        {"node": "contract_default", "rule": "matmul", "equation": "ab,bc->ac", "absorbed": []}
    ]
    torch.testing.assert_close(gm(*args), args[0] @ args[1], rtol=1e-5, atol=1e-5)


class _Tail(nn.Module):
    """A contraction (a @ b.t(), or addmm) followed by constant scalings and a bias add."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> object:
        k = self.kind
        if k == "addmm":
            return torch.addmm(c, a, b.t(), beta=0.5, alpha=3.0) * 2.0
        ab = a @ b.t()
        if k == "sub":
            return ab - c
        if k == "add_alpha":
            return torch.add(ab, c, alpha=0.5)
        if k == "sub_alpha":
            return torch.sub(ab, c, alpha=2)
        if k == "bias_then_scale":
            return (ab + c) * 2.0
        if k == "div_then_bias":
            return ab / 4.0 + c
        if k == "left_scale":
            return 2.0 * ab
        if k == "shared_scale":
            return ab * 0.5, ab
        return ab + c, ab  # "shared_bias"


_SHARED = [("matmul", "shared_intermediate", "output scaling/bias not absorbed")]


# (kind, rule, bias absorbed, alpha, beta, rejections): out = alpha * (a b^T) + beta * c.
_TAILS = [
    ("sub", "matmul", True, 1.0, -1.0, []),  # ab - c
    ("add_alpha", "matmul", True, 1.0, 0.5, []),  # ab + 0.5 c
    ("sub_alpha", "matmul", True, 1.0, -2.0, []),  # ab - 2 c
    ("bias_then_scale", "matmul", True, 2.0, 2.0, []),  # 2 (ab + c)
    ("div_then_bias", "matmul", True, 0.25, 1.0, []),  # ab / 4 + c
    ("left_scale", "matmul", False, 2.0, 0.0, []),  # 2 ab, no bias: beta 0
    ("addmm", "addmm", True, 6.0, 1.0, []),  # 2 (0.5 c + 3 ab)
    ("shared_scale", "matmul", False, 1.0, 0.0, _SHARED),  # ab also returned: nothing after it is absorbed
    ("shared_bias", "matmul", False, 1.0, 0.0, _SHARED),
]


@pytest.mark.parametrize(("kind", "rule", "bias", "alpha", "beta", "want"), _TAILS, ids=[t[0] for t in _TAILS])
def test_output_scalings_and_bias_fold_into_alpha_and_beta(
    kind: str, rule: str, bias: bool, alpha: float, beta: float, want: list
) -> None:
    """Scalings after the contraction multiply alpha (and beta once a bias is in); a bias add/sub sets beta
    to +-add's alpha; a result that is also used elsewhere keeps its scaling/bias, and says so."""
    args = (torch.randn(4, 6), torch.randn(5, 6), torch.randn(4, 5))
    gm = _module(_Tail(kind), kind, args)
    ref = gm(*args)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    (fused,) = [n for n in gm.graph.nodes if n.target is CONTRACT]
    c = [n for n in gm.graph.nodes if n.op == "placeholder"][2]
    assert fused.args[3:] == ((c if bias else None), alpha, beta), fused.args
    assert [asdict(r) for r in res.rejections] == [
        {"node": n, "rule": rule, "reason": r, "detail": d} for n, r, d in want
    ]
    absorbed_add = bias and rule != "addmm"  # addmm's own bias is an input, not an absorbed add node
    assert res.counters[f"fused:{rule}"] == 1 and res.counters["absorbed:bias"] == int(absorbed_add)
    got = gm(*args)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_a_bias_add_without_a_fake_value_is_not_absorbed() -> None:
    """An add that lost its meta['val'] (a node some rewrite made without one) cannot be checked for
    broadcasting: the pass leaves it and says why, rather than crash."""
    args = (_h(4, 6), _h(5, 6), _h(4, 5))
    gm = _module(_AfterMatmul("sub_from"), "sub_from", args)
    sub = next(n for n in gm.graph.nodes if n.target is aten.sub.Tensor)
    sub.target = aten.add.Tensor  # ab + c, an absorbable bias add, but without its fake value
    del sub.meta["val"]
    res = FuseContractions()(gm)
    assert [(r.node, r.reason) for r in res.rejections] == [("sub", "bias_broadcasts_output")], res.rejections
    assert aten.add.Tensor in {n.target for n in gm.graph.nodes}


def _export_all() -> None:
    """Export every model of this file once (shapes only matter to export; each test draws its own values)."""
    for _kind, _ in _STOPS:
        _module(_AfterMatmul(_kind), _kind, (_h(4, 6), _h(5, 6), _h(4, 5)))

    for _kind, _sa, _sb, *_ in _PLANS:
        _module(_Fn(_kind), _kind, (torch.randn(_sa), torch.randn(_sb)))

    for _kind, *_ in _TAILS:
        _module(_Tail(_kind), _kind, (torch.randn(4, 6), torch.randn(5, 6), torch.randn(4, 5)))

    _module(_Outer(), "", (torch.randn(6, 4), torch.randn(5, 6), torch.randn(4, 5)))

    _module(_Fn2(), "", (torch.randn(6, 4), _h(6, 5)))


# Under mutmut (tests/mutmut_warmup.py sets AMPLITE_TEST_PREWARM) every model is exported here, at import, in the
# fork server, so that each mutant's tests cost milliseconds within the per-mutant budget; under `make test` each
# is exported on first use by the xdist worker that runs its tests (the other worker does not pay for it).
if os.environ.get("AMPLITE_TEST_PREWARM"):
    _export_all()
