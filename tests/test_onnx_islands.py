"""ONNX ops the opset lacks in the low dtype run in an FP32 island: a bf16 einsum exports at the default
opset (ONNX's Einsum has no bfloat16 before opset 28), passes onnx.checker and runs in ONNX Runtime."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

import amplite
from amplite.onnx.export import save_onnx


class Contraction(nn.Module):
    """An unfused einsum (no --fuse-contractions), optionally followed by a ReLU."""

    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8, 4, generator=torch.Generator().manual_seed(0)))
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bi,ijk->bjk", x, self.w)
        return torch.relu(y) if self.relu else y


def _save(precision: str, relu: bool, path: Path) -> tuple[nn.Module, amplite.ConversionResult, object]:
    model = Contraction(relu).eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    result = amplite.convert(model, ((x,), {}), precision=precision, level="O1", verify=False)
    with contextlib.redirect_stdout(io.StringIO()):
        info = save_onnx(result.program, path, precision=precision)
    return model, result, info


def test_bf16_einsum_exports_checks_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "einsum.onnx"
    model_fp32, result, info = _save("bf16", relu=False, path=path)  # was: "opset 22 has no bfloat16 Einsum"
    assert info.opset == 22 and info.cleanup["fp32_islands"] == 1
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.input)}
    einsum = next(n for n in model.graph.node if n.op_type == "Einsum")
    assert all(types[i] == onnx.TensorProto.FLOAT for i in einsum.input)  # FP32 inside the island
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))  # another batch than the example
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    ref = model_fp32(x).detach()
    want = result.program.module()(x).detach()  # the plan: bf16 operands, one rounding of the result
    np.testing.assert_allclose(got, want.numpy(), rtol=2**-7, atol=0)  # one bf16 ulp: summation order
    sqnr = 20 * np.log10(np.linalg.norm(ref.numpy()) / np.linalg.norm(ref.numpy() - got))
    assert sqnr > 35


def test_bf16_einsum_before_another_op_passes_the_checker(tmp_path: Path) -> None:
    path = tmp_path / "einsum_relu.onnx"
    _, _, info = _save("bf16", relu=True, path=path)
    assert info.cleanup["fp32_islands"] == 1
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    try:  # ONNX Runtime's CPU provider has no bf16 Relu: it may refuse, but never for the Einsum
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        assert "Einsum" not in str(exc) and "NOT_IMPLEMENTED" in str(exc)


def test_fp16_einsum_needs_no_island(tmp_path: Path) -> None:
    _, _, info = _save("fp16", relu=False, path=tmp_path / "e.onnx")
    assert info.cleanup["fp32_islands"] == 0
    assert [n.op_type for n in onnx.load(str(tmp_path / "e.onnx")).graph.node].count("Cast") == info.casts
