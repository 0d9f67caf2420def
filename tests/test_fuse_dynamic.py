"""FuseContractions on symbolic shapes (dynamic batch and sequence), the gain rule, and recorded reasons."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import sympy
import torch
from torch import nn
from torch.export import Dim

import amplite
import amplite.ops
from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand, exact_div
from amplite.passes.fuse_contractions import FuseContractions

aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default
ROOT = Path(__file__).resolve().parents[1]


# The same attention block as the static tests: shapes are read at run time, so batch/seq stay symbolic.
from tests import fresh  # noqa: E402
from tests.test_fuse_contractions import Attention  # noqa: E402


def export_dynamic(model: nn.Module, x: torch.Tensor, seq: bool = True) -> torch.fx.GraphModule:
    dims = {0: Dim("batch", min=1, max=64), **({1: Dim("seq", min=2, max=512)} if seq else {})}
    return torch.export.export(model, (x,), dynamic_shapes=({**dims},), strict=False).module()


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# --- symbolic extents in the mode bookkeeping -------------------------------------------------------------


def test_exact_div_on_symbols():
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    assert exact_div(128 * s0, s0) == 128 and exact_div(s0 * s1 * 4, 2 * s1) == 2 * s0
    assert exact_div(s0, 2) is None and exact_div(128, s0) is None and exact_div(s0 + 1, s0) is None
    assert exact_div(12, 4) == 3 and exact_div(12, 5) is None


def test_symbolic_view_splits_and_merges():
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    table = ModeTable()
    o = Operand.from_shape(table, [s0 * 8, 32])  # (B*T, D) with T = 8
    o.view(table, [s0, 8, 4, 8])
    assert o.shape(table) == [s0, 8, 4, 8]
    o.view(table, [s0 * 8, 32])
    assert o.shape(table) == [s0 * 8, 32]
    with pytest.raises(NotFusable, match="irregular_reshape"):
        Operand.from_shape(table, [s0, 6]).view(table, [2, 3 * s0])  # would split the symbol


# --- the pass on dynamically exported graphs --------------------------------------------------------------


@pytest.mark.parametrize("seq", [False, True])
def test_attention_fused_with_dynamic_batch_and_seq(seq):
    torch.manual_seed(0)
    model = Attention().half()
    gm = export_dynamic(model, torch.randn(2, 8, 32).half(), seq=seq)
    res = FuseContractions()(gm)
    gm.graph.lint()
    assert res.counters["rejected:symbolic_shape"] == 0, res.rejections
    assert res.counters["fused:matmul"] == 2 and res.counters["fused:linear"] == 1, (res.counters, res.rejections)
    assert targets(gm).count(CONTRACT) == 3
    assert not set(targets(gm)) & {aten.transpose.int, aten.permute.default, aten.matmul.default}
    for shape in [(3, 8, 32), (1, 8, 32), *([(5, 13, 32)] if seq else [])]:  # batch and seq other than traced
        x = torch.randn(shape).half()
        torch.testing.assert_close(gm(x).float(), model(x).float(), rtol=3e-3, atol=3e-3)


def test_convert_dynamic_batch_fuses_and_saved_file_runs_other_batch(tmp_path):
    """The user's path: convert --dynamic-batch --fuse-contractions, save, load in a fresh process, batch 5."""
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 8, 32)
    result = amplite.convert(model, (x,), precision="bf16", level="O1", dynamic_batch=True, fuse_contractions=True)
    fuse = next(p for p in result.report.data["passes"] if p["name"] == "fuse_contractions")
    assert fuse["counters"].get("fused:matmul", 0) == 2, fuse
    assert "rejected:symbolic_shape" not in fuse["counters"]
    path = tmp_path / "attn.pt2"
    result.save(path)
    x5 = torch.randn(5, 8, 32)
    torch.save(x5, tmp_path / "x5.pt")
    expected = model(x5)
    script = textwrap.dedent("""
        import sys, torch
        import amplite.ops
        ep = torch.export.load(sys.argv[1])
        gm = ep.module()
        n = sum(1 for n in ep.graph.nodes if n.target is torch.ops.amplite.contract.default)
        out = gm(torch.load(sys.argv[2]))
        torch.save(out, sys.argv[3])
        print(n)
    """)
    run = fresh.run([sys.executable, "-c", script, str(path), str(tmp_path / "x5.pt"), str(tmp_path / "y5.pt")],
                    timeout=180, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip().splitlines()[-1]) == 3  # q·kᵀ, attn·v, out-proj survived save/load
    got = torch.load(tmp_path / "y5.pt")
    assert got.shape == (5, 8, 32)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


# --- the gain rule and recorded reasons ---------------------------------------------------------------------


class MergeHeadsShared(nn.Module):
    """The head merge's transpose also feeds another consumer: only the copying reshape can be absorbed."""

    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(32, 16)

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = y.transpose(1, 2)  # (B, T, H, Dh), non-contiguous
        return self.o(t.reshape(2, 8, 32)), t.sum()


def test_reshape_of_non_contiguous_value_counts_as_a_copy():
    torch.manual_seed(0)
    model = MergeHeadsShared().half()
    y = torch.randn(2, 4, 8, 8).half()
    gm = torch.export.export(model, (y,), strict=False).module()
    ref = gm(y)
    res = FuseContractions()(gm)
    # Absorbing the copying reshape is a gain although the weight needs a new (free) view.
    assert res.counters["fused:linear"] == 1, (res.counters, res.rejections)
    assert res.counters["skipped:nothing_to_absorb"] == 0
    assert aten.reshape.default not in targets(gm) and aten.clone.default not in targets(gm)
    assert any(r.reason == "shared_intermediate" for r in res.rejections)
    torch.testing.assert_close(gm(y)[0], ref[0], rtol=2e-3, atol=2e-3)


class ViewOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(32, 16)

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = y.transpose(1, 2).contiguous()  # shared: stays; the reshape of it is a free view
        return self.o(t.reshape(2, 8, 32)), t.sum()


def test_free_view_alone_is_not_fused_and_says_why():
    model = ViewOnly().half()
    gm = torch.export.export(model, (torch.randn(2, 4, 8, 8).half(),), strict=False).module()
    res = FuseContractions()(gm)
    assert res.counters["fused:linear"] == 0 and res.counters["skipped:nothing_to_absorb"] == 1
    why = [r for r in res.rejections if r.reason == "nothing_to_absorb"]
    assert len(why) == 1 and "new view" in why[0].detail


class Fp32Bias(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (a @ b.transpose(0, 1)).float() + bias


class TwoBiases(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return a @ b.transpose(0, 1) + c + c


class BroadcastingBias(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return a @ b.transpose(0, 1) + c  # c is (3, 4, 5): broadcasts the (4, 5) result


class SlicedOperand(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a[:, :6] @ b.transpose(0, 1)


@pytest.mark.parametrize(
    ("model", "extra", "reason"),
    [
        (Fp32Bias(), torch.randn(5), "output_cast"),
        (TwoBiases(), torch.randn(4, 5).half(), "second_bias"),
        (BroadcastingBias(), torch.randn(3, 4, 5).half(), "bias_broadcasts_output"),
        (SlicedOperand(), None, "unmodelled_view"),
    ],
)
def test_unabsorbed_neighbours_are_recorded(model, extra, reason):
    a = torch.randn(4, 8 if isinstance(model, SlicedOperand) else 6).half()
    b = torch.randn(5, 6).half()
    args = (a, b) if extra is None else (a, b, extra)
    gm = torch.export.export(model, args, strict=False).module()
    ref = gm(*args)
    res = FuseContractions()(gm)
    assert any(r.reason == reason for r in res.rejections), res.rejections
    assert res.counters[f"rejected:{reason}"] >= 1
    assert res.counters["fused:matmul"] == 1  # the contraction itself is still fused (it absorbs the transpose)
    torch.testing.assert_close(gm(*args).float(), ref.float(), rtol=3e-3, atol=3e-3)
