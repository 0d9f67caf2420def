"""amplite::contract: semantics, fake impl, autograd, backend dispatch, plan cache, .pt2 round trip."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import amplite.ops
from amplite.ops import cutensor_backend
from amplite.ops.contract import (
    active_backend,
    backend_description,
    output_shape,
    parse_equation,
    reference_contract,
)
from amplite.ops.gemm_lowering import gemm_contract
from tests import fresh

CONTRACT = torch.ops.amplite.contract.default
#: One rounding of the result to the dtype (the inputs are exact in it and the reference is fp64).
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def reference(eq, a, b, c, alpha, beta):
    out = alpha * torch.einsum(eq, a.double(), b.double())
    return out if c is None else out + beta * c.double()


PROBLEMS = [
    ("mk,kn->mn", (5, 7), (7, 3), None),
    ("bhqd,bhkd->bhqk", (2, 3, 4, 8), (2, 3, 5, 8), None),
    ("btk,nhd->bnt", (2, 4, 12), (3, 2, 6), None),  # modes alone in one input are summed
    ("mk,nk->mn", (4, 6), (3, 6), (3,)),  # broadcast bias
    ("ijk,kj->ik", (2, 3, 4), (4, 3), (2, 4)),  # full-size bias
    ("abc,cd->dba", (2, 3, 4), (4, 5), (5, 1, 2)),  # bias broadcast on a middle mode
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("eq", "sa", "sb", "sc"), PROBLEMS)
def test_matches_fp64_reference(eq, sa, sb, sc, dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(sa, generator=g).to(dtype), torch.randn(sb, generator=g).to(dtype)
    c = None if sc is None else torch.randn(sc, generator=g).to(dtype)
    out = CONTRACT(eq, a, b, c, 0.7, -1.5)
    ref = reference(eq, a, b, c, 0.7, -1.5)
    assert out.dtype == dtype and out.is_contiguous() and list(out.shape) == output_shape(eq, sa, sb)
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_accumulates_in_fp32():
    # 4096 products of (1 + 2^-10) each: an FP32 accumulator gets 4100 exactly, which fp16 represents;
    # an fp16 running sum loses the 2^-10 parts once its spacing exceeds them.
    k = 4096
    a = torch.full((1, k), 1.0 + 2**-10, dtype=torch.float16)
    b = torch.ones(k, 1, dtype=torch.float16)
    fp16_sum = torch.zeros((), dtype=torch.float16)
    for x in a[0]:
        fp16_sum += x
    assert fp16_sum.item() != 4100.0
    assert CONTRACT("mk,kn->mn", a, b, None, 1.0, 0.0).item() == 4100.0


def test_strided_inputs_are_read_in_place():
    a = torch.randn(8, 4, 6).permute(2, 0, 1)  # non-contiguous view
    b = torch.randn(6, 5)[:, ::2]  # strided slice
    out = CONTRACT("kmn,kp->mnp", a, b, None, 1.0, 0.0)
    torch.testing.assert_close(out.double(), reference("kmn,kp->mnp", a, b, None, 1.0, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("eq", "args", "err"),
    [
        ("mk,kn", ((2, 3), (3, 4)), ValueError),  # implicit output
        ("mk,kn,no->mo", ((2, 3), (3, 4)), ValueError),
        ("mm,mn->n", ((2, 2), (2, 4)), ValueError),  # diagonal
        ("mk,kn->mz", ((2, 3), (3, 4)), ValueError),  # output mode from nowhere
        ("mk,kn->mn", ((2, 3), (4, 4)), ValueError),  # size mismatch
        ("mkx,kn->mn", ((2, 3), (3, 4)), ValueError),  # rank mismatch
    ],
)
def test_rejects_bad_equations(eq, args, err):
    with pytest.raises(err):
        CONTRACT(eq, torch.randn(args[0]), torch.randn(args[1]), None, 1.0, 0.0)


def test_rejects_mixed_dtypes_and_bad_bias():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with pytest.raises(TypeError):
        CONTRACT("mk,kn->mn", a.half(), b, None, 1.0, 0.0)
    with pytest.raises(TypeError):
        CONTRACT("mk,kn->mn", a, b, torch.randn(4).half(), 1.0, 1.0)
    with pytest.raises(ValueError):
        CONTRACT("mk,kn->mn", a, b, torch.randn(3), 1.0, 1.0)


def test_parse_equation():
    assert parse_equation(" bhqd , bhkd -> bhqk ") == ("bhqd", "bhkd", "bhqk")


def test_fake_impl_and_opcheck():
    with FakeTensorMode():
        a = torch.empty(2, 3, 4, dtype=torch.bfloat16)
        b = torch.empty(4, 5, dtype=torch.bfloat16)
        out = CONTRACT("bmk,kn->bnm", a, b, None, 1.0, 0.0)
        assert out.shape == (2, 5, 3) and out.dtype == torch.bfloat16
    a = torch.randn(2, 3, 4, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)
    c = torch.randn(5, 1, requires_grad=True)
    torch.library.opcheck(CONTRACT, ("bmk,kn->bnm", a, b, c, 0.5, 2.0))


@pytest.mark.parametrize(
    ("eq", "sa", "sb", "sc"),
    [
        ("bmk,kn->bnm", (2, 3, 4), (4, 5), (5, 1)),
        ("ij,jkl->k", (2, 3), (3, 4, 2), None),
        ("ab,cb->ac", (2, 3), (4, 3), (4,)),
    ],
)
def test_gradients(eq, sa, sb, sc):
    a = torch.randn(sa, dtype=torch.float64, requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, requires_grad=True)
    c = None if sc is None else torch.randn(sc, dtype=torch.float64, requires_grad=True)
    inputs = (a, b) if c is None else (a, b, c)
    fn = (
        (lambda a, b: CONTRACT(eq, a, b, None, 0.3, 0.0))
        if c is None
        else (lambda a, b, c: CONTRACT(eq, a, b, c, 0.3, -2.0))
    )
    assert torch.autograd.gradcheck(fn, inputs)


def test_half_gradients_keep_dtype():
    a = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float16, requires_grad=True)
    CONTRACT("mk,kn->mn", a, b, None, 2.0, 0.0).float().sum().backward()
    assert a.grad.dtype == torch.float16
    torch.testing.assert_close(a.grad.float(), 2.0 * b.float().sum(1).expand(3, 4), rtol=1e-3, atol=1e-3)


# --- backend dispatch ------------------------------------------------------------------------------------


def test_cpu_always_uses_torch(monkeypatch):
    for value in ("", "torch", "cutensor"):
        monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", value)
        assert active_backend("cpu") == "torch"
    assert "CPU" in backend_description("cpu")


def test_cuda_dispatch(monkeypatch):
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    monkeypatch.setattr(cutensor_backend, "probe", lambda d, dt=None: cutensor_backend.Probe(True))
    assert active_backend("cuda") == "cutensor"
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "torch")
    assert active_backend("cuda:0") == "torch"
    monkeypatch.setattr(cutensor_backend, "probe", lambda d, dt=None: cutensor_backend.Probe(False, "no lib"))
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND")
    assert active_backend("cuda") == "torch"
    assert "no lib" in backend_description("cuda")
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "cutensor")
    with pytest.raises(RuntimeError, match="no lib"):
        active_backend("cuda")
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "cublas")
    with pytest.raises(ValueError):
        active_backend("cpu")


class FakeBinaryContraction:
    """Stands in for nvmath.tensor.BinaryContraction on CPU, enforcing the rules the backend relies on."""

    created = 0

    def __init__(self, expr, a, b, *, c=None, out=None, stream=None):
        FakeBinaryContraction.created += 1
        self.freed = False
        self.expr = expr
        self.info = {
            k: (t.shape, t.stride(), t.dtype) for k, t in (("a", a), ("b", b), ("c", c), ("out", out)) if t is not None
        }
        self.ops = {"a": a, "b": b, "c": c, "out": out}
        self.has_c = c is not None
        self.planned = False

    def plan(self, stream=None):
        self.planned = True

    def free(self):
        self.freed = True

    def reset_operands(self, a=None, b=None, *, c=None, out=None, stream=None):
        for k, t in (("a", a), ("b", b), ("c", c), ("out", out)):
            if t is not None:
                assert (t.shape, t.stride(), t.dtype) == self.info[k], k
            self.ops[k] = t

    def execute(self, *, alpha=1.0, beta=None, release_workspace=False, stream=None):
        assert self.planned and (beta is not None) == self.has_c
        lhs, out_subs = self.expr.split("->")
        sa, sb = lhs.split(",")
        for subs, other in ((sa, sb), (sb, sa)):  # cuTENSOR: no single-input summed modes
            assert all(ch in other or ch in out_subs for ch in subs), self.expr
        o = self.ops
        res = alpha * torch.einsum(self.expr, o["a"].float(), o["b"].float())
        if self.has_c:
            assert o["c"].shape == res.shape  # C carries every output mode
            res = res + beta * o["c"].float()
        o["out"].copy_(res)
        return o["out"]


@pytest.fixture
def fake_nvmath(monkeypatch):
    mod = types.ModuleType("nvmath")
    mod.tensor = types.SimpleNamespace(BinaryContraction=FakeBinaryContraction)
    monkeypatch.setitem(sys.modules, "nvmath", mod)
    # CPU allocations are not 256-byte aligned the way CUDA's caching allocator is; pin the alignment
    # so plan reuse is deterministic here (test_alignment_is_part_of_the_key covers it).
    monkeypatch.setattr(cutensor_backend, "_alignment", lambda t: 256)
    cutensor_backend.clear_cache()
    FakeBinaryContraction.created = 0
    yield
    cutensor_backend.clear_cache()


@pytest.mark.parametrize(("eq", "sa", "sb", "sc"), PROBLEMS[:2] + PROBLEMS[3:])
def test_cutensor_backend_logic(fake_nvmath, eq, sa, sb, sc):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(sa, generator=g).half(), torch.randn(sb, generator=g).half()
    c = None if sc is None else torch.randn(sc, generator=g).half()
    for _ in range(3):
        out = cutensor_backend.contract(eq, a, b, c, 0.5, 2.0)
        torch.testing.assert_close(out.double(), reference(eq, a, b, c, 0.5, 2.0), rtol=2e-3, atol=2e-3)
    stats = cutensor_backend.cache_stats()
    assert stats["plans"] == 1 and stats["hits"] == 2 and FakeBinaryContraction.created == 1


def test_cutensor_backend_squeezes_lone_unit_modes_and_falls_back(fake_nvmath):
    a, b = torch.randn(3, 1, 4).half(), torch.randn(4, 5).half()
    out = cutensor_backend.contract("mxk,kn->mn", a, b, None, 1.0, 0.0)
    torch.testing.assert_close(out.double(), reference("mxk,kn->mn", a, b, None, 1.0, 0.0), rtol=2e-3, atol=2e-3)
    # A lone mode of extent > 1 cannot go to cuTENSOR: the op falls back to torch.einsum.
    assert cutensor_backend.contract("mxk,kn->mn", torch.randn(3, 2, 4).half(), b, None, 1.0, 0.0) is None
    assert cutensor_backend.cache_stats()["fallbacks"] == 1


def test_cutensor_broadcast_bias_rounds_once(fake_nvmath):
    # alpha * a@b = 70000 overflows fp16; the bias brings it back to 10000. Adding a broadcast bias after
    # rounding the product (the old path) gave inf; passing it as C (expanded) rounds once.
    a, b = torch.full((2, 4), 70.0).half(), torch.full((4, 3), 250.0).half()
    c = torch.full((3,), -60000.0).half()
    out = cutensor_backend.contract("mk,kn->mn", a, b, c, 1.0, 1.0)
    assert torch.isfinite(out).all() and out.float().eq(10000.0).all()


def test_cutensor_backend_new_strides_get_new_plan(fake_nvmath):
    a, b = torch.randn(4, 6).half(), torch.randn(6, 5).half()
    cutensor_backend.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    cutensor_backend.contract("km,kn->mn", a.t().contiguous(), b, None, 1.0, 0.0)
    cutensor_backend.contract("mk,kn->mn", a.t().contiguous().t(), b, None, 1.0, 0.0)
    assert cutensor_backend.cache_stats()["plans"] == 3


def test_alignment_is_part_of_the_key():
    base = torch.empty(64, dtype=torch.float16)
    assert cutensor_backend._alignment(base[1:]) == 2
    k0 = cutensor_backend._key("mk,kn->mn", {"a": base[:8].view(2, 4)})
    k1 = cutensor_backend._key("mk,kn->mn", {"a": base[1:9].view(2, 4)})
    assert k0 != k1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cutensor_on_cuda(dtype):
    pytest.importorskip("nvmath")
    assert active_backend("cuda") == "cutensor"
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4, 128, 8, 64, device="cuda", generator=g).to(dtype)  # (b, t, h, d) head split
    b = torch.randn(4, 128, 8, 64, device="cuda", generator=g).to(dtype)
    c = torch.randn(128, device="cuda", generator=g).to(dtype)
    eq = "bqhd,bkhd->bhqk"
    for _ in range(2):  # second call goes through the cached plan
        out = CONTRACT(eq, a, b, c, 0.125, 1.0)
        torch.testing.assert_close(out.double(), reference(eq, a, b, c, 0.125, 1.0), rtol=TOL[dtype], atol=1e-2)
    assert cutensor_backend.cache_stats()["hits"] >= 1


# --- .pt2 round trip ---------------------------------------------------------------------------------------


class UsesContract(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.amplite.contract(
            "bhqd,bhkd->bhqk", a.transpose(1, 2), b.transpose(1, 2), None, 0.5, 0.0
        ).softmax(-1)


LOAD = """
import io, logging, sys, torch
said = io.StringIO()  # what the failed load logs (torch.export logs the unknown op's error before it raises)
logging.getLogger("torch.export").addHandler(logging.StreamHandler(said))
try:  # a fresh process that has not imported amplite does not know the op
    torch.export.load(sys.argv[1])
    print("loaded without amplite")
except Exception as exc:
    print("refused:", type(exc).__name__, " ".join((said.getvalue() + str(exc)).split())[-2000:])
import amplite.ops
ep = torch.export.load(sys.argv[1])
a, b = torch.load(sys.argv[2])
print(float(ep.module()(a, b).double().sum()))
"""


def test_save_load_needs_import(tmp_path):
    a, b = torch.randn(2, 5, 3, 4).half(), torch.randn(2, 6, 3, 4).half()
    ep = torch.export.export(UsesContract(), (a, b), strict=False)
    assert any(n.target is CONTRACT for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "m.pt2")
    torch.save((a, b), tmp_path / "ab.pt")
    expected = float(UsesContract()(a, b).double().sum())
    done = fresh.run(  # one fresh process: the load without amplite, then with amplite.ops imported
        [sys.executable, "-c", textwrap.dedent(LOAD), str(tmp_path / "m.pt2"), str(tmp_path / "ab.pt")],
        timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    missing, ok = done.stdout.strip().splitlines()[-2:]
    assert missing.startswith("refused:") and "amplite" in missing, missing
    assert float(ok) == pytest.approx(expected, rel=1e-6)


def test_gpu_bench_dry_run(capsys):
    """bench/gpu_contract.py --dry-run completes on CPU, so the benchmark cannot rot unnoticed."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_contract.py"
    spec = importlib.util.spec_from_file_location("gpu_contract_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--dtypes", "bf16", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("contract ") >= 3 and "+ FuseContractions" in out and "fused:matmul': 2" in out


def test_contract_is_registered() -> None:
    assert amplite.ops is not None and hasattr(torch.ops.amplite, "contract")


# --- reference_contract and the torch backend's GEMM, called directly (survivors of the full mutation run) ---

H = torch.float16


@pytest.mark.parametrize(
    ("a", "b", "c", "alpha", "beta", "want"),
    [
        # -120000 is beyond fp16; 2 * 60000 too: both must be FP32 for the sum to come back to 0
        (300.0, -400.0, 60000.0, 1.0, 2.0, 0.0),
        # alpha scales the FP32 product into range, then the bias (beta = 1) is added: -60000 + 1056
        (300.0, -400.0, 1056.0, 0.5, 1.0, -58944.0),
        # alpha = 2 is applied; a beta without a bias adds nothing
        (3.0, 5.0, None, 2.0, 1.5, 30.0),
        # beta = 0 drops the bias
        (3.0, 5.0, 7.0, 1.0, 0.0, 15.0),
    ],
)
def test_reference_contract_scales_and_adds_in_fp32_then_rounds_once(a, b, c, alpha, beta, want) -> None:
    """alpha * einsum + beta * c on FP32-upcast operands, one rounding to the operands' dtype at the end."""
    ta, tb = torch.tensor([[a]], dtype=H), torch.tensor([[b]], dtype=H)
    tc = None if c is None else torch.tensor([[c]], dtype=H)
    out = reference_contract("ij,jk->ik", ta, tb, tc, alpha, beta)
    assert out.dtype == H and out.is_contiguous() and out.shape == (1, 1)
    assert out.item() == want
    assert gemm_contract("ij,jk->ik", ta, tb, tc, alpha, beta).item() == want, "the torch backend agrees"


def test_reference_contract_follows_the_equation() -> None:
    """A transposed output and a mode summed alone: the same numbers as torch.einsum in FP64."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 4, generator=g).to(H), torch.randn(4, 5, generator=g).to(H)
    out = reference_contract("ijk,kl->li", a, b, None, 0.5, 0.0)
    want = 0.5 * torch.einsum("ijk,kl->li", a.double(), b.double())
    assert out.shape == (5, 2) and out.dtype == H
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-3)


def test_gemm_contract_reads_an_equation_with_spaces() -> None:
    """Spaces around the subscripts are ignored, also for the output order (a permuted, batched result)."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g)
    out = gemm_contract("bij, bjk -> kbi", a, b, None, 1.0, 0.0)
    torch.testing.assert_close(out, torch.einsum("bij,bjk->kbi", a, b))


@pytest.mark.parametrize("eq", ["bij,bjk->bik", "ij,jk->ik"])
def test_gemm_contract_scales_by_alpha_without_a_bias(eq: str) -> None:
    """alpha = 2 without a bias scales the product, batched (baddbmm) or not (addmm)."""
    g = torch.Generator().manual_seed(3)
    lead = (2,) if eq.startswith("b") else ()
    a, b = torch.randn(*lead, 3, 4, generator=g), torch.randn(*lead, 4, 5, generator=g)
    torch.testing.assert_close(gemm_contract(eq, a, b, None, 2.0, 0.0), 2.0 * torch.einsum(eq, a, b))


@pytest.mark.parametrize("eq", ["bij,bjk->bik", "ij,jk->ik"])
def test_gemm_contract_scaled_zero_keeps_its_sign_as_alpha_times_the_product(eq: str) -> None:
    """alpha * (1 * 0) with alpha = -2 is -0.0, as the reference gives: no zero bias is added to it."""
    lead = (1,) if eq.startswith("b") else ()
    a, b = torch.ones(*lead, 1, 1, dtype=H), torch.zeros(*lead, 1, 1, dtype=H)
    out = gemm_contract(eq, a, b, None, -2.0, 0.0)
    assert torch.signbit(reference_contract(eq, a, b, None, -2.0, 0.0)).all()
    assert out.item() == 0.0 and torch.signbit(out).all()


@pytest.mark.parametrize(
    ("sb", "sc"),
    [((4, 5), (3, 1)), ((4, 1), (3, 1)), ((4, 5), (1, 5)), ((4, 5), ())],
    ids=["bias-per-row", "full-bias-one-column", "bias-per-column", "scalar-bias"],
)
def test_gemm_contract_adds_a_broadcast_bias_per_row_or_column(sb, sc) -> None:
    """Without batch modes (addmm) a bias of any broadcast shape gives reference numbers."""
    g = torch.Generator().manual_seed(4)
    a, b, c = torch.randn(3, 4, generator=g), torch.randn(sb, generator=g), torch.randn(sc, generator=g)
    out = gemm_contract("mk,kn->mn", a, b, c, 0.5, -1.5)
    torch.testing.assert_close(out, reference_contract("mk,kn->mn", a, b, c, 0.5, -1.5))


@pytest.mark.parametrize(("sa", "sb"), [((3, 4, 5), (4, 6)), ((4,), (4, 6)), ((3, 4), (4, 6, 1)), ((3, 4), (4,))])
def test_gemm_contract_refuses_operands_whose_rank_is_not_the_equations(sa, sb) -> None:
    """A rank that does not match the subscripts is a ValueError, never a silently truncated contraction."""
    with pytest.raises(ValueError):
        gemm_contract("mk,kn->mn", torch.randn(sa), torch.randn(sb), None, 1.0, 0.0)
