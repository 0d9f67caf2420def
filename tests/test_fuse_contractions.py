"""FuseContractions and its equation derivation: property tests, a transformer block, negative cases."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import amplite.ops  # noqa: F401  (registers amplite::contract)
from amplite.passes import einsum_equation as eqn
from amplite.passes.einsum_equation import ModeTable, NotFusable, Operand
from amplite.passes.fuse_contractions import FuseContractions, FusionResult
from amplite.passes.meta import CAST_KEY, CONTRACT_KEY
from tests.exported import Fn, export_eval

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default
ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SIZES = st.sampled_from([1, 2, 3, 4, 6])

# --- random data-movement chains -------------------------------------------------------------------------
# A chain is drawn backwards from the shape the contraction needs, so every chain is valid by construction:
# each step picks an op and computes the shape its input must have had.

Op = tuple


@st.composite
def chains(draw, target: list[int], max_ops: int = 4) -> tuple[list[int], list[Op]]:
    """A source shape and a list of forward ops that turn a source of that shape into ``target``."""
    shape = list(target)
    ops: list[Op] = []
    for _ in range(draw(st.integers(0, max_ops))):
        kind = draw(st.sampled_from(["permute", "transpose", "split", "merge", "unsqueeze", "expand", "scale"]))
        n = len(shape)
        if kind == "permute" and n > 1:
            p = draw(st.permutations(range(n)))
            src = [0] * n
            for i, d in enumerate(p):
                src[d] = shape[i]
            ops.append(("permute", list(p)))
            shape = src
        elif kind == "transpose" and n > 1:
            d0, d1 = draw(st.integers(-n, n - 1)), draw(st.integers(-n, n - 1))
            src = list(shape)
            src[d0], src[d1] = src[d1], src[d0]
            ops.append(("transpose", d0, d1))
            shape = src
        elif kind == "split" and n > 1 and n < 5:  # forward view splits: the source had them merged
            i = draw(st.integers(0, n - 2))
            ops.append(("view", list(shape)))
            shape = [*shape[:i], shape[i] * shape[i + 1], *shape[i + 2 :]]
        elif kind == "merge" and n < 5:  # forward view merges: the source had the dim split
            i = draw(st.integers(0, n - 1))
            divs = [d for d in range(1, shape[i] + 1) if shape[i] % d == 0]
            f = draw(st.sampled_from(divs))
            ops.append(("view", list(shape)))
            shape = [*shape[:i], f, shape[i] // f, *shape[i + 1 :]]
        elif kind == "unsqueeze" and 1 in shape and n > 1:
            i = shape.index(1)
            ops.append(("unsqueeze", i))
            shape = shape[:i] + shape[i + 1 :]
        elif kind == "expand":
            i = draw(st.integers(0, n - 1))
            ops.append(("expand", list(shape)))
            shape = [*shape[:i], 1, *shape[i + 1 :]]
        elif kind == "scale":
            ops.append(("scale", draw(st.sampled_from([0.5, 0.125, -2.0, 0.3]))))
    ops.reverse()
    return shape, ops


def run_eager(x: torch.Tensor, ops: list[Op]) -> torch.Tensor:
    for op in ops:
        if op[0] == "permute":
            x = x.permute(op[1])
        elif op[0] == "transpose":
            x = x.transpose(op[1], op[2])
        elif op[0] == "view":
            x = x.reshape(op[1])
        elif op[0] == "unsqueeze":
            x = x.unsqueeze(op[1])
        elif op[0] == "expand":
            x = x.expand(op[1])
        elif op[0] == "scale":
            x = x * op[1]
    return x


def run_modes(table: ModeTable, shape: list[int], ops: list[Op]) -> Operand:
    o = Operand.from_shape(table, shape)
    for op in ops:
        if op[0] == "permute":
            o.permute(op[1])
        elif op[0] == "transpose":
            o.transpose(op[1], op[2])
        elif op[0] == "view":
            o.view(table, op[1])
        elif op[0] == "unsqueeze":
            o.unsqueeze(op[1])
        elif op[0] == "expand":
            o.expand_to(table, op[1])
        elif op[0] == "scale":
            o.scale *= op[1]
    return o


@st.composite
def matmul_problems(draw):
    """Operand shapes for a batched matmul (batch dims broadcast) plus a chain for each operand."""
    m, k, n = draw(SIZES), draw(SIZES), draw(SIZES)
    batch = draw(st.lists(SIZES, max_size=2))
    bb = [draw(st.sampled_from([d, 1])) for d in batch][draw(st.integers(0, len(batch))) :]
    ta, tb = [*batch, m, k], [*bb, k, n]
    return draw(chains(ta)), draw(chains(tb))


#: What the chains may legitimately hit: a merge then split at another point ([2,3] -> [6] -> [3,2]),
#: contracted dims factored differently on the two sides, an output mode only an expand provides.
LIMITS = {"irregular_reshape", "incompatible_factorization", "broadcast_only_mode"}


def derive(problem) -> tuple[eqn.Equation, float]:
    """The equation and alpha for a matmul of two chains (raises NotFusable when not expressible)."""
    (sa, oa), (sb, ob) = problem
    table = ModeTable()
    a, b = run_modes(table, sa, oa), run_modes(table, sb, ob)
    groups = eqn.matmul_groups(table, a, b)
    e = eqn.build_equation(table, a, b, groups)
    return e, a.scale * b.scale * e.factor


def expressible(problem) -> bool:
    """Whether the chains can be one einsum; the known limits are asserted to be the only ones."""
    try:
        derive(problem)
    except NotFusable as e:
        assert e.reason in LIMITS, e
        return False
    return True


def derived_contract(problem, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager matmul of the chains, amplite::contract with the derived equation), both in ``dtype``."""
    (sa, oa), (sb, ob) = problem
    g = torch.Generator().manual_seed(seed)
    xa = torch.randn(sa, generator=g).to(dtype)
    xb = torch.randn(sb, generator=g).to(dtype)
    e, alpha = derive(problem)
    got = CONTRACT(e.equation, xa.view(e.a_view), xb.view(e.b_view), None, alpha, 0.0)
    ref = torch.matmul(run_eager(xa.double(), oa), run_eager(xb.double(), ob))
    return ref, got.view(ref.shape)


@settings(max_examples=150, deadline=None)
@given(problem=matmul_problems(), seed=st.integers(0, 2**16))
def test_derived_equation_matches_eager_fp32(problem, seed):
    assume(expressible(problem))
    ref, got = derived_contract(problem, torch.float32, seed)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    problem=matmul_problems(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_derived_equation_matches_eager_low_precision(problem, seed, dtype):
    assume(expressible(problem))
    ref, got = derived_contract(problem, dtype, seed)
    assert got.dtype == dtype
    # One rounding of the result (inputs are exact in dtype; the reference is fp64 on the same inputs).
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("shape", "new", "ok"),
    [([6, 4], [4, 6], False), ([2, 3, 4], [6, 4], True), ([6, 4], [2, 12], True), ([6, 4], [3, 8], True),
     ([4, 6], [8, 3], True), ([3, 2], [2, 3], False), ([2, 6], [4, 3], True)],
)  # fmt: skip
def test_view_regrouping(shape, new, ok):
    table = ModeTable()
    o = Operand.from_shape(table, shape)
    if ok:
        o.view(table, new)
        assert o.shape(table) == new
    else:
        with pytest.raises(NotFusable, match="irregular_reshape"):
            o.view(table, new)


def test_unify_rejects_incompatible_factorizations():
    table = ModeTable()
    a = Operand.from_shape(table, [2, 3])
    a.view(table, [6])
    b = Operand.from_shape(table, [3, 2])
    b.view(table, [6])
    with pytest.raises(NotFusable, match="incompatible_factorization"):
        eqn.unify(table, a.dims[0], b.dims[0])


# --- the pass on exported graphs ---------------------------------------------------------------------------


def export_gm(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, args, strict=False).module()


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def check_graph(gm: torch.fx.GraphModule) -> None:
    gm.graph.lint()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not aten._assert_tensor_metadata.default:
            assert isinstance(n.meta.get("val"), torch.Tensor), n.name


class Chains(nn.Module):
    def __init__(self, ops_a: list[Op], ops_b: list[Op]) -> None:
        super().__init__()
        self.ops_a, self.ops_b = ops_a, ops_b

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(run_eager(a, self.ops_a), run_eager(b, self.ops_b)) * 0.5


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=matmul_problems())
def test_pass_on_random_chains_fp32(problem):
    (sa, oa), (sb, ob) = problem
    a, b = torch.randn(sa), torch.randn(sb)
    gm = export_gm(Chains(oa, ob), a, b)
    ref = gm(a, b)
    ok = expressible(problem)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    check_graph(gm)
    torch.testing.assert_close(gm(a, b), ref, rtol=1e-5, atol=1e-5)
    if ok:
        assert res.counters["fused:matmul"] == 1, (res.counters, res.rejections)
        assert targets(gm).count(CONTRACT) == 1
        # Only free views (source splits, result merge) may remain of the data movement.
        movement = {aten.permute.default, aten.transpose.int, aten.expand.default, aten.unsqueeze.default,
                    aten.mul.Tensor}  # fmt: skip
        assert not movement & set(targets(gm))
    elif res.counters["rejected:incompatible_factorization"]:
        assert CONTRACT not in targets(gm)
    else:  # the offending reshape or expand is kept as the operand's source; the rest is fused
        assert res.counters["fused:matmul"] == 1
        assert res.counters["rejected:broadcast_only_mode"] + res.counters["rejected:irregular_reshape"] >= 1


class Attention(nn.Module):
    """A small self-attention block written the way transformer code usually is."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, d = x.shape
        dh = d // self.h
        q = self.q(x).view(bsz, t, self.h, dh).transpose(1, 2)
        k = self.k(x).view(bsz, t, self.h, dh).transpose(1, 2)
        v = self.v(x).view(bsz, t, self.h, dh).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1) * (1.0 / math.sqrt(dh))).softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(bsz, t, d)
        return self.o(y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_contractions_fused(dtype, tmp_path):
    torch.manual_seed(0)
    model = Attention().to(dtype)
    x = torch.randn(2, 8, 32).to(dtype)
    gm = export_gm(model, x)
    ref = gm(x)
    res = FuseContractions()(gm)
    check_graph(gm)
    assert isinstance(res, FusionResult) and res.modified
    # q·kᵀ (with its scale) and attn·v are fused; the head merge is absorbed by the output projection.
    assert res.counters["fused:matmul"] == 2 and res.counters["fused:linear"] == 1
    assert res.counters["absorbed:scale"] == 1 and res.counters["skipped:nothing_to_absorb"] == 3
    left = set(targets(gm))
    assert not left & {aten.transpose.int, aten.permute.default, aten.matmul.default, aten.mul.Tensor}
    assert targets(gm).count(CONTRACT) == 3
    qk = next(f for f in res.fused if "mul" in f.absorbed)
    assert {"transpose", "transpose_1", "transpose_3"} <= set(qk.absorbed)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    out = gm(x)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    # Re-export, save, load, run: the pipeline's path.
    ep = torch.export.export(gm, (x,), strict=False)
    path = tmp_path / "attn.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    assert CONTRACT in targets(loaded)
    torch.testing.assert_close(loaded(x), out, rtol=0, atol=0)


def test_fp32_graph_untouched_by_default():
    model = Attention()
    x = torch.randn(2, 8, 32)
    gm = export_gm(model, x)
    before = targets(gm)
    res = FuseContractions()(gm)
    assert not res.modified and targets(gm) == before
    assert res.counters["rejected:dtype_not_enabled"] == 6
    assert {r.reason for r in res.rejections} == {"dtype_not_enabled"}


class GraphOutputTranspose(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kt = k.transpose(-2, -1)
        return q @ kt * 0.25, kt


class IrregularReshape(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.transpose(0, 1).reshape(6, 4) @ b


class SharedTranspose(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        at = a.transpose(0, 1)
        return (at @ b) + at.sum()


@pytest.mark.parametrize(
    ("model", "shapes", "node", "reason"),
    [
        (GraphOutputTranspose(), [(2, 3, 4), (2, 5, 4)], "transpose", "intermediate_is_graph_output"),
        (IrregularReshape(), [(6, 4), (4, 5)], "reshape", "irregular_reshape"),
        (SharedTranspose(), [(4, 3), (4, 5)], "transpose", "shared_intermediate"),
    ],
)
def test_not_fused_away(model, shapes, node, reason):
    args = [torch.randn(s) for s in shapes]
    gm = export_gm(model, *args)
    ref = gm(*args)
    res = FuseContractions(dtypes=ALL_FLOATS, fuse_plain=True)(gm)
    check_graph(gm)
    assert node in {n.name for n in gm.graph.nodes}, "the blocked node must stay materialised"
    assert any(r.node == node and r.reason == reason for r in res.rejections), res.rejections
    assert res.counters[f"rejected:{reason}"] == 1
    torch.testing.assert_close(gm(*args), ref, rtol=1e-5, atol=1e-5)


class LinearScaleBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, 3, 4, 3) -> (b, 3, 12) merge after a permute, then linear, then scale.
        return self.lin(x.permute(0, 1, 3, 2).reshape(x.shape[0], 3, 12)) / 4.0


class MatmulBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 2.0 * (a.transpose(-1, -2) @ b) - self.bias


class Addmm(nn.Module):
    def forward(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, a.t(), b, beta=0.5, alpha=3.0)


class Baddbmm(nn.Module):
    def forward(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(c, a, b.transpose(1, 2), alpha=0.5)


class Einsum(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bij,bkj->bik", a.permute(0, 2, 1), b) * 0.5


class CastInChain(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.transpose(0, 1).to(torch.float16) @ b


CASES: list[tuple[str, Callable[[], nn.Module], list[tuple[int, ...]], str, set[str]]] = [
    (
        "linear",
        LinearScaleBias,
        [(2, 3, 4, 3)],
        "linear",
        {"absorbed:permute", "absorbed:view", "absorbed:scale"},
    ),
    ("matmul_bias", MatmulBias, [(2, 4, 3), (2, 4, 6)], "matmul", {"absorbed:bias", "absorbed:scale"}),
    ("addmm", Addmm, [(3, 5), (4, 3), (4, 5)], "addmm", {"absorbed:transpose"}),
    ("baddbmm", Baddbmm, [(1, 3, 5), (2, 3, 4), (2, 5, 4)], "addmm", {"absorbed:transpose"}),
    ("einsum", Einsum, [(2, 4, 3), (2, 5, 4)], "einsum", {"absorbed:permute", "absorbed:scale"}),
]


@pytest.mark.parametrize(("name", "make", "shapes", "rule", "absorbed"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rules(name, make, shapes, rule, absorbed, dtype):
    torch.manual_seed(1)
    model = make().to(dtype)
    args = [torch.randn(s).to(dtype) for s in shapes]
    gm = export_gm(model, *args)
    ref = gm(*args)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    check_graph(gm)
    assert res.counters[f"fused:{rule}"] == 1, (res.counters, res.rejections)
    assert absorbed <= {k for k, v in res.counters.items() if v}
    assert targets(gm).count(CONTRACT) == 1
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(gm(*args), ref, rtol=tol, atol=tol)


def test_cast_inside_chain_becomes_cast_of_source():
    a, b = torch.randn(4, 3), torch.randn(4, 5).half()
    gm = export_gm(CastInChain(), a, b)
    ref = gm(a, b)
    res = FuseContractions()(gm)
    check_graph(gm)
    assert res.counters["fused:matmul"] == 1 and res.counters["absorbed:cast"] == 1
    assert aten.transpose.int not in targets(gm)
    (cast,) = [n for n in gm.graph.nodes if n.meta.get(CAST_KEY)]
    assert cast.args[0].name == "a" and cast.kwargs["dtype"] == torch.float16
    torch.testing.assert_close(gm(a, b), ref, rtol=2e-3, atol=2e-3)


def test_output_scaling_shared_is_not_absorbed():
    class Shared(nn.Module):
        def forward(self, a, b):
            s = a.t() @ b
            return s * 0.5, s

    a, b = torch.randn(4, 3), torch.randn(4, 5)
    gm = export_gm(Shared(), a, b)
    ref = gm(a, b)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    assert aten.mul.Tensor in targets(gm) and res.counters["absorbed:scale"] == 0
    assert res.counters["fused:matmul"] == 1  # the transpose alone is still absorbed
    for got, want in zip(gm(a, b), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_fused_on_cuda(dtype):
    """The fused graph on the CUDA backend (cuTENSOR when nvmath-python is installed) matches unfused."""
    torch.manual_seed(0)
    model = Attention(d=256, heads=8).to("cuda", dtype)
    x = torch.randn(4, 128, 256, device="cuda").to(dtype)
    gm = export_gm(model, x)
    ref = gm(x)
    res = FuseContractions()(gm)
    assert res.counters["fused:matmul"] == 2
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(gm(x), ref, rtol=tol, atol=tol)


def test_shared_cast_is_a_silent_source():
    """A cast the precision passes share between consumers stops the chain without a rejection."""

    class SharedCast(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ah = a.half()
            return ah.t() @ b, (ah @ b.t()) * 0.5

    a, b = torch.randn(4, 4), torch.randn(4, 4).half()
    gm = export_gm(SharedCast(), a, b)
    ref = gm(a, b)
    res = FuseContractions()(gm)
    check_graph(gm)
    assert res.counters["fused:matmul"] == 2 and res.rejections == []
    assert aten.t.default not in targets(gm)
    for got, want in zip(gm(a, b), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# --- fusion passes: fold_batchnorm, fuse_contractions, contraction rules, einsum equations, cutensor ---


def _fuse(model: nn.Module, *args: torch.Tensor, **kw: object) -> tuple[torch.fx.GraphModule, dict]:
    gm = export_eval(model, *args)
    ref = model(*args)
    res = FuseContractions(dtypes=ALL_FLOATS, **kw)(gm)
    gm.recompile()
    torch.testing.assert_close(gm(*args), ref, rtol=1e-5, atol=1e-5)
    return gm, {k: v for k, v in res.counters.items() if v}


def test_linear_of_a_vector_and_without_bias_is_fused() -> None:
    w = torch.randn(5, 4)
    _, counters = _fuse(Fn(lambda v: F.linear(v, w) * 0.5), torch.randn(4))
    assert counters.get("fused:linear") == 1, counters
    _, counters = _fuse(Fn(lambda x: F.linear(x.transpose(0, 1), w)), torch.randn(4, 3))
    assert counters.get("fused:linear") == 1, counters


def test_addmm_defaults_alpha_and_beta_to_one() -> None:
    c, a, b = torch.randn(3, 5), torch.randn(4, 3), torch.randn(4, 5)
    _, counters = _fuse(Fn(lambda c, a, b: torch.addmm(c, a.t(), b)), c, a, b)
    assert counters.get("fused:addmm") == 1, counters


@pytest.mark.parametrize("equation", ["ij, jk -> ik", "ij,jk"])
def test_einsum_with_spaces_or_implicit_output_is_fused(equation: str) -> None:
    _, counters = _fuse(Fn(lambda a, b: torch.einsum(equation, a.t(), b)), torch.randn(3, 4), torch.randn(3, 5))
    assert counters.get("fused:einsum") == 1, counters


def test_a_bias_that_broadcasts_the_result_is_not_absorbed() -> None:
    gm, counters = _fuse(Fn(lambda x, w, b: (x.t() @ w) + b), torch.randn(8, 4), torch.randn(8, 1), torch.randn(4, 6))
    # fused, the add left alone, with its reason recorded
    expected = {"fused:matmul": 1, "absorbed:transpose": 1, "rejected:bias_broadcasts_output": 1}
    assert counters.items() >= expected.items(), counters
    assert aten.add.Tensor in [n.target for n in gm.graph.nodes]


def test_squeeze_in_a_chain_is_absorbed() -> None:
    _, counters = _fuse(Fn(lambda a, b: a.squeeze(1).t() @ b), torch.randn(3, 1, 4), torch.randn(3, 5))
    assert (
        counters.get("fused:matmul") == 1
        and counters.get("absorbed:squeeze", 0) + counters.get("absorbed:view", 0) >= 1
    ), counters
    _, counters = _fuse(Fn(lambda a, b: a.squeeze().t() @ b), torch.randn(3, 1, 4), torch.randn(3, 5))
    assert counters.get("fused:matmul") == 1, counters


def test_squeeze_of_one_dim_keeps_the_other_unit_dims() -> None:
    _, counters = _fuse(Fn(lambda a, b: a.squeeze(1) @ b), torch.randn(1, 1, 4), torch.randn(4, 5))
    assert counters.get("fused:matmul") == 1, counters


def test_a_bias_is_viewed_to_the_contraction_modes() -> None:
    # a.reshape(6, 4) merges two source dims: the contraction runs on (2, 3, 4), its bias as (2, 3, 5).
    gm, counters = _fuse(
        Fn(lambda a, w, b: a.reshape(6, 4) @ w + b), torch.randn(2, 3, 4), torch.randn(4, 5), torch.randn(6, 5)
    )
    assert counters.items() >= {"fused:matmul": 1, "absorbed:view": 1, "absorbed:bias": 1}.items(), counters
    contract = next(n for n in gm.graph.nodes if n.target is CONTRACT)
    assert list(contract.args[3].meta["val"].shape) == [2, 3, 5]


def test_shared_intermediate_with_a_scaling_is_a_recorded_rejection() -> None:
    a, b = torch.randn(4, 3), torch.randn(4, 5)
    gm = export_eval(Fn(lambda a, b: ((s := a.t() @ b) * 0.5, s)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    assert [r.reason for r in res.rejections] == ["shared_intermediate"], res.rejections


def test_layout_only_contiguous_and_tensor_products_around_a_contraction() -> None:
    cl = Fn(lambda a, b: a.contiguous(memory_format=torch.channels_last) @ b)
    gm, counters = _fuse(cl, torch.randn(2, 3, 4, 5), torch.randn(5, 6))
    assert counters.items() >= {"fused:matmul": 1, "absorbed:contiguous": 1}.items(), counters  # a layout change only
    contract = next(n for n in gm.graph.nodes if n.target is CONTRACT)
    assert contract.meta[CONTRACT_KEY] == {"rule": "matmul", "absorbed": ["contiguous"]}
    # A product with a tensor (not a constant) on either side is not a scaling to absorb.
    gated = Fn(lambda a, b, t: t * (a.t() @ b) + (a.t() @ b) * t)
    _, counters = _fuse(gated, torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5))
    expected = {"fused:matmul": 2, "absorbed:transpose": 2, "rejected:tensor_scale": 2}
    assert counters.items() >= expected.items(), counters


def test_rejections_say_what_was_not_absorbed_and_a_cast_on_the_source_is_the_source() -> None:
    from dataclasses import asdict

    a, b = torch.randn(4, 3), torch.randn(4, 5)
    gm = export_eval(Fn(lambda a, b: ((t := a.t()) @ b, t)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS, fuse_plain=True)(gm)
    assert [asdict(r) for r in res.rejections] == [
        {"node": "t", "rule": "matmul", "reason": "intermediate_is_graph_output", "detail": "not absorbed into matmul"}
    ], res.rejections
    ints = (torch.randint(-3, 4, (4, 3)).float(), torch.randint(-3, 4, (4, 5)).float())  # exact in fp16
    gm, counters = _fuse(Fn(lambda a, b: a.half().t() @ b.half()), *ints)
    assert counters.get("fused:matmul") == 1, counters


def test_rejections_name_their_rule_and_fuse_plain_fuses_bare_contractions() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    gm = export_eval(Fn(lambda a, b: torch.einsum("...ij,...jk->...ik", a, b)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    assert [(r.rule, r.reason) for r in res.rejections] == [("einsum", "einsum_ellipsis")], res.rejections
    plain = Fn(lambda a, b: a @ b)
    _, counters = _fuse(plain, torch.randn(3, 4), torch.randn(4, 5), fuse_plain=True)
    assert counters.items() >= {"fused:matmul": 1}.items(), counters
    _, counters = _fuse(plain, torch.randn(3, 4), torch.randn(4, 5))
    assert counters.items() >= {"skipped:nothing_to_absorb": 1}.items(), counters


def test_a_vector_operand_of_matmul_is_not_fused() -> None:
    _, counters = _fuse(Fn(lambda v, m: v @ m.t()), torch.randn(4), torch.randn(5, 4))
    assert counters.items() >= {"rejected:vector_operand": 1}.items(), counters
    _, counters = _fuse(Fn(lambda m, v: m.t() @ v), torch.randn(4, 5), torch.randn(4))
    assert counters.items() >= {"rejected:vector_operand": 1}.items(), counters


# fusion: why a bias add after a contraction is or is not absorbed (full run of 2026-12-01)


class _BiasAfterMatmul(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ab = a @ b
        if self.kind == "c+ab":
            return c + ab
        if self.kind == "c-ab":
            return c - ab
        if self.kind == "ab+1.5":
            return ab + 1.5
        if self.kind == "ab+c.half":
            return ab + c.half()
        return torch.add(ab, c, alpha=0.5)


@pytest.mark.parametrize(
    ("kind", "bias_fused", "reason"),
    [
        ("c+ab", True, None),  # a contraction on the right of add is a bias add too
        ("alpha", True, None),  # add's alpha is absorbed with the bias
        ("c-ab", False, "bias_not_tensor"),  # c - ab is not ab + bias
        ("ab+1.5", False, "bias_not_tensor"),
        ("ab+c.half", False, "bias_dtype"),
    ],
)
def test_bias_add_after_a_contraction_is_absorbed_or_says_why(kind: str, bias_fused: bool, reason: str | None):
    args = (torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5))
    gm = torch.export.export(_BiasAfterMatmul(kind), args, strict=False).module()
    ref = gm(*args)
    res = FuseContractions(dtypes=ALL_FLOATS, fuse_plain=True)(gm)
    reasons = {r.reason for r in res.rejections}
    adds = [n for n in gm.graph.nodes if n.target in (aten.add.Tensor, aten.sub.Tensor)]
    assert res.counters["fused:matmul"] == 1, (res.counters, res.rejections)
    assert (not adds) == bias_fused, f"{kind}: bias absorbed should be {bias_fused}, graph adds {adds}"
    if reason is None:
        assert not {r for r in reasons if r.startswith("bias")}, reasons
    else:
        assert reason in reasons, f"{kind}: the rejection must name {reason}, got {res.rejections}"
    torch.testing.assert_close(gm(*args), ref, rtol=1e-3, atol=1e-3)


# --- FuseContractions.ensures on hand-built contract nodes (survivors of the full mutation run) ------------


def _contracts(*specs: tuple) -> torch.fx.GraphModule:
    """One amplite::contract per ``(equation, a, b, c, out)``: each a (shape, dtype) value or None (no value)."""
    g = torch.fx.Graph()
    outs = []
    for i, (equation, *vals) in enumerate(specs):
        nodes = []
        for name, v in zip("abco", vals, strict=True):
            if name == "c" and v is None:
                nodes.append(None)
                continue
            n = g.placeholder(f"{name}{i}") if name != "o" else None
            if n is not None and v is not None:
                n.meta["val"] = torch.empty(v[0], dtype=v[1])
            nodes.append(n)
        a, b, c, _ = nodes
        node = g.call_function(CONTRACT, (equation, a, b, c, 1.0, 1.0 if c is not None else 0.0))
        node.meta["val"] = torch.empty(vals[3][0], dtype=vals[3][1])
        outs.append(node)
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


F32, F16 = torch.float32, torch.float16


def _broken(gm: torch.fx.GraphModule) -> str:
    from amplite.passes.base import PostconditionError

    with pytest.raises(PostconditionError) as e:
        FuseContractions().ensures(gm)
    assert e.value.pass_name == "fuse_contractions"
    return e.value.condition


def test_ensures_holds_for_consistent_contracts_with_a_bias() -> None:
    ok = ("ij,jk->ik", ((2, 3), F16), ((3, 4), F16), ((4,), F16), ((2, 4), F16))
    assert FuseContractions().ensures(_contracts(ok)) is None


def test_ensures_names_a_mode_whose_static_sizes_disagree() -> None:
    """'j' is 3 in a and 4 in b: the condition names the mode, the equation and both sizes."""
    gm = _contracts(("ij,jk->ik", ((2, 3), F32), ((4, 5), F32), None, ((2, 5), F32)))
    cond = _broken(gm)
    assert "mode 'j' of 'ij,jk->ik' has sizes 3, 4" in cond and cond.startswith("contract ")


def test_ensures_names_the_dtypes_a_contract_mixes_including_its_bias() -> None:
    """fp16 operands with an fp32 bias: 'mixes dtypes' listing both."""
    gm = _contracts(("ij,jk->ik", ((2, 3), F16), ((3, 4), F16), ((2, 4), F32), ((2, 4), F16)))
    assert "mixes dtypes ['torch.float16', 'torch.float32']" in _broken(gm)


def test_ensures_checks_the_contracts_after_one_without_values() -> None:
    """A contract whose operand has no recorded value is skipped, not the end of the check."""
    unknown = ("ij,jk->ik", None, ((3, 4), F32), None, ((2, 4), F32))
    bad = ("ij,jk->ik", ((2, 3), F32), ((5, 4), F32), None, ((2, 4), F32))
    assert FuseContractions().ensures(_contracts(unknown)) is None
    assert "mode 'j'" in _broken(_contracts(unknown, bad))
