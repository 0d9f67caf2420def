"""End-to-end conversion through the API: graph facts in the saved .pt2, sizes, verification."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import amplite
from amplite.converter.graph_stats import node_compute_dtype
from fixtures.zoo import TEST_FIXTURES, make
from tests.conftest import compute_dtypes

aten = torch.ops.aten

REDUCTIONS = (aten.mean, aten.sum, aten.var, aten.std)


def test_transformer_fp16_o1_saved_graph_facts(tmp_path: Path) -> None:
    model, inputs = make("transformer")
    result = amplite.convert(model, inputs, precision="fp16", level="O1")
    path = result.save(tmp_path / "t.pt2")
    program = torch.export.load(str(path))
    graph = program.graph

    softmax, norms = compute_dtypes(graph, aten.softmax), compute_dtypes(graph, aten.layer_norm)
    reductions = [d for op in REDUCTIONS for d in compute_dtypes(graph, op)]
    matmuls = compute_dtypes(graph, aten.matmul) + compute_dtypes(graph, aten.linear)
    assert len(softmax) == 2 and len(norms) == 4 and len(reductions) >= 1 and len(matmuls) == 17
    assert set(softmax) == set(norms) == set(reductions) == {torch.float32}
    assert set(matmuls) == {torch.float16}
    out_node = next(n for n in graph.nodes if n.op == "output")
    assert all(a.meta["val"].dtype == torch.float32 for a in out_node.args[0])
    assert result.passed is True
    (metrics,) = result.report.outputs
    assert metrics["sqnr_db"] >= 40 and metrics["out_nonfinite"] == 0

    x = inputs[0][0]
    torch.testing.assert_close(program.module()(x), model(x), atol=2e-3, rtol=2e-2)


def test_o2_pt2_is_at_most_055_of_fp32_size(tmp_path: Path) -> None:
    model, (args, kwargs) = make("transformer")
    fp32 = tmp_path / "fp32.pt2"
    torch.export.save(torch.export.export(model, args, kwargs, strict=False), str(fp32))
    low = amplite.convert(model, (args, kwargs), level="O2").save(tmp_path / "o2.pt2")
    ratio = low.stat().st_size / fp32.stat().st_size
    assert ratio <= 0.55, ratio


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", [n for n in TEST_FIXTURES if n != "overflow"])
def test_every_fixture_converts_and_verifies(name: str, precision: str) -> None:
    model, inputs = make(name)
    for level in ("O1", "O2"):
        result = amplite.convert(model, inputs, precision=precision, level=level)
        assert result.passed, (level, result.report.outputs)
        after = result.report.data["graph"]["after"]
        assert after["low_precision_flop_share"] > 0.5, (level, after)


def test_overflow_fixture_fp32_islands_save_o1_but_not_o3() -> None:
    model, inputs = make("overflow")
    o1 = amplite.convert(model, inputs, level="O1")
    assert o1.passed and o1.report.outputs[0]["out_nonfinite"] == 0
    # the pow is on the FP32 list and range-flagged: it stays FP32, reported under the stronger layer (range)
    assert any(n["op"] == "pow.Tensor_Scalar" and n["rule"] == "range" for n in o1.report.fp32_nodes)
    o3 = amplite.convert(model, inputs, level="O3")
    assert o3.passed is False and o3.report.outputs[0]["out_nonfinite"] > 0
    assert o3.report.data["warnings"]


def test_user_model_is_bit_identical_after_conversion() -> None:
    model, inputs = make("cnn")
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = {k: v.data_ptr() for k, v in model.state_dict().items()}
    amplite.convert(model, inputs, level="O2")
    for k, v in model.state_dict().items():
        assert v.dtype == params[k].dtype and torch.equal(v, params[k]), k
        assert v.data_ptr() == ids[k]


def test_keep_fp32_module_override_and_report_reason() -> None:
    model, inputs = make("transformer")
    result = amplite.convert(model, inputs, keep_fp32=["module:layers.0.*"])
    plan = result.report.data["plan"]
    layer0 = [p for p in plan if p["module"].startswith("layers.0") and p["op"] == "linear.default"]
    layer1 = [p for p in plan if p["module"].startswith("layers.1") and p["op"] == "linear.default"]
    assert layer0 and all(p["dtype"] == "float32" and p["reason"] == "user:keep module:layers.0.*" for p in layer0)
    assert layer1 and all(p["dtype"] == "float16" for p in layer1)
    linear_dtypes = {}
    for node in result.program.graph.nodes:
        if node.target is aten.linear.default:
            linear_dtypes.setdefault(node_compute_dtype(node), 0)
            linear_dtypes[node_compute_dtype(node)] += 1
    assert linear_dtypes == {torch.float32: 6, torch.float16: 7}


def test_o0_changes_nothing_and_env_level_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = make("mlp")
    o0 = amplite.convert(model, inputs, level="O0")
    assert o0.report.data["graph"]["after"]["nodes_by_dtype"] == {"float32": 3}
    assert o0.report.outputs[0]["sqnr_db"] == "inf"
    monkeypatch.setenv("AMPLITE_LEVEL", "O2")
    result = amplite.convert(model, inputs)
    assert result.report.data["config"]["level"] == "O2"
    assert result.report.data["config"]["level_source"] == "AMPLITE_LEVEL"
    assert result.report.data["weights"]["ratio"] < 0.55


def test_dynamic_batch_program_runs_other_batch_sizes() -> None:
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, dynamic_batch=True)
    x = torch.randn(9, 32)
    torch.testing.assert_close(result.module()(x), model(x), atol=5e-3, rtol=5e-3)


def test_low_precision_io() -> None:
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, low_precision_io=True)
    placeholders = [n for n in result.program.graph.nodes if n.op == "placeholder" and n.name == "x"]
    assert placeholders[0].meta["val"].dtype == torch.float16
    assert result.module()(inputs[0][0].half()).dtype == torch.float16
    assert result.passed


def test_keyword_inputs_as_dict() -> None:
    class KW(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.lin(input_ids) * scale}

    model = KW().eval()
    result = amplite.convert(model, {"input_ids": torch.randn(2, 4), "scale": torch.randn(2, 4)})
    assert [o["name"] for o in result.report.outputs] == ["output['logits']"]
    assert result.passed


def test_report_schema_basics() -> None:
    model, inputs = make("rmsnorm")
    data = amplite.convert(model, inputs, level="O2").report.data
    assert data["schema"] == "amplite.report" and data["schema_version"] == 1
    assert data["versions"]["torch"] == torch.__version__
    names = [p["name"] for p in data["passes"]]
    assert names == [
        "inline_regions",
        "strip_export_checks",
        "fold_batchnorm",
        "calibrate",
        "range_guard",
        "guard_constants",
        "annotate_precision",
        "saturate_fills",
        "insert_casts",
        "cleanup_casts",
        "store_low_params",
        "check_dtypes",
        "build_program",
    ]
    assert data["graph"]["after"]["casts"] >= 1
    reasons = {n["op"]: n["reason"] for n in data["fp32_nodes"]}
    assert reasons["pow.Tensor_Scalar"] == "fp32-list:transcendental"
    assert reasons["mean.dim"] == "fp32-list:reduction"
    assert data["weights"]["bytes_after"] < data["weights"]["bytes_before"]


def test_fused_transformer_round_trips_and_reports_fusions(tmp_path: Path) -> None:
    model, inputs = make("transformer")
    plain = amplite.convert(model, inputs, level="O2")
    fused = amplite.convert(model, inputs, level="O2", fuse_contractions=True)
    contracts = [n for n in fused.program.graph.nodes if n.target is torch.ops.amplite.contract.default]
    assert len(contracts) >= 4  # q·kᵀ and attn·v in each of the two layers
    assert not [n for n in fused.program.graph.nodes if n.target in (aten.transpose.int, aten.matmul.default)]
    record = next(p for p in fused.report.data["passes"] if p["name"] == "fuse_contractions")
    assert {f["rule"] for f in record["details"]["fused"]} >= {"matmul"}
    assert fused.report.data["config"]["contract_backend"]
    assert fused.passed
    x = inputs[0][0]
    torch.testing.assert_close(fused.module()(x), plain.module()(x), atol=2e-3, rtol=2e-2)
    loaded = torch.export.load(str(fused.save(tmp_path / "fused.pt2")))
    torch.testing.assert_close(loaded.module()(x), fused.module()(x))


class WithConstants(torch.nn.Module):
    """Tensors created in forward become lifted constants (``lifted_tensor_N``) in the export."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + torch.tensor([0.5, 0.5, 0.5, 0.5])


def test_lifted_constants_survive_re_export() -> None:
    model = WithConstants().eval()
    x = torch.randn(2, 4)
    result = amplite.convert(model, (x,), level="O2")
    assert result.passed
    torch.testing.assert_close(result.module()(x), model(x), atol=1e-2, rtol=1e-2)
