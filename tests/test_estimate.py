"""The GPU time estimate: FLOP and byte counts per op family, the roofline, autocast's model, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import amplite
from amplite.errors import ConfigError
from amplite.estimate import PROFILES, estimate, get_profile
from amplite.estimate.autocast import autocast_costs
from amplite.estimate.cost import graph_costs, node_cost
from tests.conftest import Cli

H100 = PROFILES["H100"]


def _costs(module: nn.Module, *args: torch.Tensor) -> dict[str, object]:
    """Cost per op name of the exported FP32 program of ``module``."""
    ep = torch.export.export(module.eval(), args)
    return {c.op: c for c in graph_costs(ep.graph, H100)}


def test_linear_flops_and_bytes_are_the_hand_computed_ones() -> None:
    m, k, n = 8, 16, 32
    c = _costs(nn.Linear(k, n), torch.randn(m, k))["linear.default"]
    assert c.flops == 2 * m * n * k
    assert c.bytes == (m * k + n * k + n + m * n) * 4  # input, weight, bias read; output written
    assert c.kind == "contraction"


def test_conv_flops_count_input_channels_and_kernel() -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1)
    c = _costs(conv, torch.randn(1, 3, 8, 8))["conv2d.default"]
    out = 1 * 4 * 8 * 8
    assert c.flops == 2 * out * 3 * 3 * 3
    assert c.bytes == (1 * 3 * 8 * 8 + 4 * 3 * 3 * 3 + 4 + out) * 4


def test_attention_flops_are_four_b_h_l_s_e() -> None:
    class Attn(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v)

    q = torch.randn(2, 3, 5, 8)
    k = torch.randn(2, 3, 7, 8)
    c = _costs(Attn(), q, k, torch.randn(2, 3, 7, 8))["scaled_dot_product_attention.default"]
    assert c.flops == 4 * (2 * 3 * 5 * 8) * 7


def test_elementwise_and_reduction_count_per_element_and_views_cost_nothing() -> None:
    class Ops(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + 1.0).transpose(0, 1).sum(dim=0)

    costs = _costs(Ops(), torch.randn(6, 10))
    assert costs["add.Tensor"].flops == 60 and costs["add.Tensor"].bytes == 2 * 60 * 4
    assert costs["sum.dim_IntList"].flops == 60  # one per input element
    assert costs["sum.dim_IntList"].bytes == (60 + 6) * 4
    assert "transpose.int" not in costs  # a view launches nothing


def test_a_cast_costs_its_bytes_read_and_written() -> None:
    class Cast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float16)

    c = _costs(Cast(), torch.randn(4, 25))["to.dtype"]
    assert c.kind == "cast" and c.flops == 0 and c.bytes == 100 * (4 + 2)


def _fake_mm(n: int, dtype: torch.dtype) -> torch.fx.Node:
    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        a, b = (mode.from_tensor(torch.empty(0)).new_empty((n, n), dtype=dtype) for _ in range(2))
        pa, pb = graph.placeholder("a"), graph.placeholder("b")
        pa.meta["val"], pb.meta["val"] = a, b
        mm = graph.call_function(torch.ops.aten.mm.default, (pa, pb))
        mm.meta["val"] = torch.ops.aten.mm.default(a, b)
    graph.output(mm)
    return mm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_large_matmul_sits_on_its_roofline(dtype: torch.dtype) -> None:
    n = 8192
    c = node_cost(_fake_mm(n, dtype), H100)
    assert c is not None
    peak = H100.bf16_tflops if dtype == torch.bfloat16 else H100.fp32_tflops
    compute = 2 * n**3 / (peak * 1e12)
    memory = 3 * n * n * dtype.itemsize / (H100.bandwidth_gbs * 1e9)
    assert compute > memory  # compute-bound at this size
    assert c.seconds == pytest.approx(compute + H100.launch_us * 1e-6, rel=1e-9)
    if dtype == torch.bfloat16:
        assert c.seconds == pytest.approx(1.1113e-3 + 4e-6, rel=1e-3)  # 1.1e12 FLOP at 989.4 TFLOP/s + launch


def test_tf32_option_uses_the_tf32_peak_for_fp32_matmuls() -> None:
    node = _fake_mm(4096, torch.float32)
    slow, fast = node_cost(node, H100), node_cost(node, H100, tf32=True)
    launch = H100.launch_us * 1e-6
    expected = H100.tf32_tflops / H100.fp32_tflops
    assert (slow.seconds - launch) / (fast.seconds - launch) == pytest.approx(expected, rel=0.01)


def test_autocast_casts_weights_once_per_forward_and_activations_per_op() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x).relu())

    ep = torch.export.export(Shared().eval(), (torch.randn(4, 16),))
    sig = ep.graph_signature
    costs = autocast_costs(ep.graph, torch.float16, H100, {*sig.inputs_to_parameters})
    casts = [c for c in costs if c.kind == "cast"]
    # weight and bias once each (cached); the input x and nothing else (relu of fp16 stays fp16)
    assert len(casts) == 3, [c.node for c in casts]
    linears = [c for c in costs if c.op == "linear.default"]
    assert [c.dtype for c in linears] == ["float16", "float16"]


def test_unknown_profile_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="H100"):
        get_profile("B300")
    assert get_profile("h100-sxm").name == "H100"


def test_convert_reports_the_estimate_and_o2_is_cheaper_than_fp32_on_a_large_layer() -> None:
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    result = amplite.convert(model, (torch.randn(256, 1024),), precision="bf16", level="O2", gpu_profile="A100")
    est = result.report.data["estimate"]
    assert est["device"] == "A100" and est["label"] == "an estimate, not a measurement"
    assert set(est["seconds"]) == {"fp32", "autocast", "amplite"}
    assert est["ratio_vs_fp32"] < 0.5  # 16× the matmul peak, half the bytes
    assert est["ratio_vs_autocast"] < 1.0  # autocast re-casts weights every forward
    assert 0 < est["cast_share"] < 1 and est["top_nodes"][0]["op"] == "linear.default"
    assert "estimate" in result.report.data["timings"]


def test_estimate_does_not_specialise_a_dynamic_batch_program() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    est = estimate(ep, ep, torch.float16)
    assert est["seconds"]["fp32"] > 0
    assert ep.module()(torch.randn(7, 8)).shape == (7, 8)  # still dynamic after the estimate


def test_cli_prints_the_estimate_line_and_the_report_carries_it(tmp_path: Path, cli: Cli) -> None:
    ep = torch.export.export(nn.Sequential(nn.Linear(32, 32), nn.ReLU()).eval(), (torch.randn(4, 32),))
    torch.export.save(ep, tmp_path / "m.pt2")
    res = cli("convert", tmp_path / "m.pt2", "--gpu-profile", "L4", "-o", tmp_path / "out.pt2")
    assert res.exit_code == 0, res.stderr
    assert "estimated on L4:" in res.stdout and "an estimate, not a measurement" in res.stdout
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["estimate"]["device"] == "L4"
    bad = cli("convert", tmp_path / "m.pt2", "--gpu-profile", "nope", "-o", tmp_path / "bad.pt2")
    assert bad.exit_code == 2 and "unknown GPU profile" in bad.stderr and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line
    assert not (tmp_path / "bad.pt2").exists()


def test_markdown_and_html_render_the_estimate() -> None:
    from amplite.report.html import render_html
    from amplite.report.markdown import render_markdown

    result = amplite.convert(nn.Linear(16, 16), (torch.randn(2, 16),), precision="fp16")
    md, html = render_markdown(result.report.data), render_html(result.report.data)
    assert "Estimated GPU time on H100" in md and "× autocast" in md
    assert "<h2>Estimated GPU time</h2>" in html and 'id="estimate"' in html
