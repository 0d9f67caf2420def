"""The ``torch`` backend of ``amplite::contract`` (what every user without nvmath-python runs).

It must keep the promised numerics (FP32 accumulation, alpha and beta·C in FP32, one rounding) while
running the unfused graph's own GEMM: low-precision operands straight into ``bmm``/``baddbmm``, with no
FP32 copy of the operands (the upcast einsum it replaces was 0.21x permute+bmm on an H200).
"""

from __future__ import annotations

import importlib
import math
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amplite.ops  # noqa: F401  (registers the op)
from amplite.ops import gemm_lowering

contract_mod = importlib.import_module("amplite.ops.contract")
CONTRACT = torch.ops.amplite.contract.default
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
#: Half the spacing of the dtype's subnormals: one rounding of a result below the smallest normal number is
#: off by up to this much, whatever its size (fp16: results below 6.1e-5).
SUBNORMAL_HALF_SPACING = {dt: 0.5 * torch.finfo(dt).smallest_normal * torch.finfo(dt).eps for dt in UNIT_ROUNDOFF}

# (equation, a shape, b shape): matmul, batch modes, permuted/transposed outputs (the swapped GEMM),
# modes summed alone in one input, outer products, dot products and head split/merge layouts.
CASES = [
    ("mk,kn->mn", (33, 40), (40, 17)),
    ("mk,nk->mn", (33, 40), (17, 40)),
    ("mk,kn->nm", (33, 40), (40, 17)),
    ("bhqd,bhkd->bhqk", (2, 3, 9, 16), (2, 3, 11, 16)),
    ("bqhd,bkhd->bhqk", (2, 9, 3, 16), (2, 11, 3, 16)),
    ("bhqk,bhkd->bqhd", (2, 3, 9, 11), (2, 3, 11, 16)),
    ("bij,bjk->bki", (3, 8, 20), (3, 20, 6)),
    ("abc,cd->dba", (4, 5, 24), (24, 7)),
    ("ijz,jk->ik", (6, 20, 3), (20, 5)),
    ("ij,jkz->ik", (6, 20), (20, 5, 3)),
    ("ij,kl->ijkl", (3, 4), (5, 6)),
    ("bi,bi->b", (4, 64), (4, 64)),
    ("ibj,jk->bik", (7, 2, 48), (48, 9)),
    ("bsd,od->bso", (2, 5, 32), (24, 32)),
    ("bhqd,bhkd->qk", (2, 3, 5, 16), (2, 3, 7, 16)),  # three contracted modes
    ("i,j->ij", (9,), (11,)),  # no contracted mode
]


def _reference(eq, a, b, c, alpha, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact value in FP64, and the FP32-accumulation error bound (K · 2⁻²³ · Σ|a||b|)."""
    ref = alpha * torch.einsum(eq, a.double(), b.double())
    mag = abs(alpha) * torch.einsum(eq, a.double().abs(), b.double().abs())
    if c is not None:
        ref = ref + beta * c.double()
    lhs, out = eq.split("->")
    sa, sb = lhs.split(",")
    sizes = dict(zip(sa, a.shape, strict=True)) | dict(zip(sb, b.shape, strict=True))
    terms = math.prod(n for ch, n in sizes.items() if ch not in out)
    return ref, terms * 2.0**-23 * mag


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("eq", "sa", "sb"), CASES)
@pytest.mark.parametrize("bias", ["none", "full", "row", "scalar"])
def test_one_rounding_against_fp64(eq, sa, sb, dtype, bias) -> None:
    """Within half an ulp of the exact result (+ FP32 accumulation error): one rounding, after alpha and C.

    alpha = 0.3 and beta = -1.7 are not powers of two, so rounding the product before scaling, or adding
    the bias after a rounding, exceeds the bound.
    """
    g = torch.Generator().manual_seed(zlib.crc32(f"{eq}|{bias}".encode()))  # the same inputs in every process
    a = torch.randn(sa, generator=g).to(dtype)
    b = torch.randn(sb, generator=g).to(dtype)
    shape = contract_mod.output_shape(eq, sa, sb)
    c_shape = {"none": None, "full": shape, "row": shape[-1:], "scalar": []}[bias]
    c = None if c_shape is None else (3 * torch.randn(c_shape, generator=g)).to(dtype)
    alpha, beta = 0.3, -1.7
    out = CONTRACT(eq, a, b, c, alpha, beta)
    assert out.dtype == dtype and list(out.shape) == shape and out.is_contiguous()
    ref, acc = _reference(eq, a, b, c, alpha, beta)
    err = (out.double() - ref).abs()
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 2 * acc + SUBNORMAL_HALF_SPACING[dtype]
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max()):.2f}x one rounding"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_views_are_read_as_given(dtype) -> None:
    """Transposed, permuted and sliced operands (what fusion absorbs) give the same one-rounding result."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 9, 3, 32, generator=g).to(dtype)[:, :, :, ::2]  # sliced: stride 2 in d
    k = torch.randn(2, 16, 3, 11, generator=g).to(dtype).transpose(1, 3)  # [b, k, h, d] as a permuted view
    c = torch.randn(9, generator=g).to(dtype)[None, None, :, None].expand(2, 3, 9, 11)  # stride-0 bias
    assert not q.is_contiguous() and not k.is_contiguous()
    out = CONTRACT("bqhd,bkhd->bhqk", q, k, c, 0.3, -1.7)
    ref, acc = _reference("bqhd,bkhd->bhqk", q, k, c, 0.3, -1.7)
    err = (out.double() - ref).abs()
    assert bool((err <= UNIT_ROUNDOFF[dtype] * ref.abs() + 2 * acc + SUBNORMAL_HALF_SPACING[dtype]).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alpha_one_and_beta_zero_match_the_reference_op(dtype) -> None:
    """bmm (alpha 1, no C) and baddbmm with beta 0 (C ignored, even a NaN one) agree with the spelled-out op."""
    a, b = torch.randn(2, 3, 9, 16).to(dtype), torch.randn(2, 3, 11, 16).to(dtype)
    eq = "bhqd,bhkd->bhqk"
    for alpha in (1.0, 0.125):
        got = CONTRACT(eq, a, b, torch.full((11,), float("nan"), dtype=dtype), alpha, 0.0)
        want = contract_mod.reference_contract(eq, a, b, None, alpha, 0.0)
        torch.testing.assert_close(got, want, rtol=UNIT_ROUNDOFF[dtype] * 2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scaled_overflow_stays_finite(dtype) -> None:
    """131072 overflows fp16; alpha = 1/8 (applied in FP32 by the GEMM) brings it to 16384 exactly."""
    q = torch.full((2, 4, 8, 64), 64.0, dtype=dtype)
    k = torch.full((2, 4, 8, 64), 32.0, dtype=dtype)
    out = CONTRACT("bqhd,bkhd->bhqk", q, k, None, 0.125, 0.0)
    assert bool((out == 16384.0).all())
    c = torch.full((4,), -61440.0, dtype=dtype)
    assert bool((CONTRACT("bqhd,bkhd->bhqk", q, k, c, 1.0, 2.0) == 8192.0).all())


class _Ops(TorchDispatchMode):
    """Records (op name, input dtypes, output dtype) of every aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype], torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "amplite":  # look inside the custom op: run its implementation under this mode
            with self:
                return contract_mod.contract._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        ins = [x.dtype for x in args if isinstance(x, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, ins, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("eq", "sa", "sb", "c_shape", "alpha", "gemm"),
    [
        ("bhqd,bhkd->bhqk", (2, 3, 9, 16), (2, 3, 11, 16), None, 1.0, "bmm"),
        ("bqhd,bkhd->bhqk", (2, 9, 3, 16), (2, 11, 3, 16), None, 0.125, "baddbmm"),
        ("bhqk,bhkd->bqhd", (2, 3, 9, 11), (2, 3, 11, 16), (16,), 1.0, "baddbmm"),
        ("mk,kn->nm", (33, 40), (40, 17), (17, 33), 0.5, "addmm"),
        ("ijz,jk->ik", (6, 20, 3), (20, 5), None, 1.0, "mm"),
        ("md,nd->mn", (16, 32), (24, 32), None, 0.5, "addmm"),
    ],
)
def test_fallback_issues_one_low_precision_gemm(eq, sa, sb, c_shape, alpha, gemm, dtype) -> None:
    """One bmm/baddbmm on low-precision inputs, no cast to FP32 anywhere, no einsum."""
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    c = None if c_shape is None else torch.randn(c_shape).to(dtype)
    with _Ops() as ops:
        out = CONTRACT(eq, a, b, c, alpha, 1.0)
    assert out.dtype == dtype
    gemms = [call for call in ops.calls if call[0] in ("bmm", "baddbmm", "mm", "addmm", "einsum")]
    assert [g[0] for g in gemms] == [gemm]
    assert all(dt == dtype for dt in gemms[0][1]), gemms
    wide = [call for call in ops.calls if call[2] in (torch.float32, torch.float64)]
    assert wide == [], f"FP32 work in the fallback: {wide}"
    assert not [call for call in ops.calls if call[0] in ("_to_copy", "to", "_to_dtype")]


def test_linear_bias_goes_to_addmm_one_dimensional() -> None:
    """A linear with a per-column bias is F.linear's own call: addmm with the 1-D bias (cuBLASLt's epilogue
    on CUDA adds it without a pass over the result), the weight read transposed in place."""
    x, w, bias = torch.randn(16, 32).bfloat16(), torch.randn(24, 32).bfloat16(), torch.randn(24).bfloat16()
    seen = []

    class Args(_Ops):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "addmm":
                seen.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Args() as ops:
        out = CONTRACT("md,nd->mn", x, w, bias, 1.0, 1.0)
    assert seen == [[(24,), (16, 32), (32, 24)]]
    assert not [call for call in ops.calls if call[0] in ("clone", "copy_", "_to_copy")]  # views only
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=2**-8, atol=1e-2)


def test_transposed_output_needs_no_permute_copy() -> None:
    """An output in (batch, cols, rows) order is produced by the swapped GEMM, not a permute + copy."""
    assert gemm_lowering.plan("bij,bjk->bki")[-1] is True
    a, b = torch.randn(3, 8, 20).half(), torch.randn(3, 20, 6).half()
    with _Ops() as ops:
        CONTRACT("bij,bjk->bki", a, b, None, 1.0, 0.0)
    assert not [call for call in ops.calls if call[0] in ("clone", "copy_", "contiguous")]


def test_aoti_decomposition_is_the_gemm() -> None:
    """The decomposition deploy/aoti.py packages is the same GEMM lowering (no FP32 upcast in the package)."""
    from amplite.deploy.aoti import _decompose_contractions

    class M(torch.nn.Module):
        def forward(self, a, b):
            return torch.ops.amplite.contract("bhqd,bhkd->bhqk", a, b, None, 0.125, 0.0)

    a, b = torch.randn(1, 2, 4, 8).half(), torch.randn(1, 2, 5, 8).half()
    ep, n = _decompose_contractions(torch.export.export(M(), (a, b)))
    targets = {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    assert n == 1 and any("baddbmm" in t for t in targets), targets
    assert not any("_to_copy" in t or "einsum" in t for t in targets), targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the cuBLAS side of the same lowering")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("eq", "sa", "sb"), CASES[:7])
def test_cuda_fallback_is_one_low_precision_gemm(monkeypatch, eq, sa, sb, dtype) -> None:
    """On CUDA without cuTENSOR: the same single bmm/baddbmm on fp16/bf16 operands, within one rounding
    (twice the CPU bound: cuBLAS may reduce split-K partial sums in the operands' dtype, as torch allows)."""
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "torch")
    a = torch.randn(sa, device="cuda").to(dtype)
    b = torch.randn(sb, device="cuda").to(dtype)
    c = torch.randn(contract_mod.output_shape(eq, sa, sb)[-1:], device="cuda").to(dtype)
    with _Ops() as ops:
        out = CONTRACT(eq, a, b, c, 0.3, -1.7)
    gemms = [call for call in ops.calls if call[0] in ("bmm", "baddbmm", "mm", "addmm", "einsum")]
    want = "baddbmm" if gemm_lowering.plan(eq)[2] else "addmm"  # batch modes: baddbmm; none: F.linear's addmm
    assert [g[0] for g in gemms] == [want] and all(dt == dtype for dt in gemms[0][1])
    assert not [call for call in ops.calls if call[2] in (torch.float32, torch.float64)]
    ref, acc = _reference(eq, a.cpu(), b.cpu(), c.cpu(), 0.3, -1.7)
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= 2 * (UNIT_ROUNDOFF[dtype] * ref.abs() + 2 * acc) + SUBNORMAL_HALF_SPACING[dtype]).all())
