"""ONNX output of every test fixture at fp16/bf16 and O1/O2: checker, precision plan, ORT run, Cast counts.

One test per (fixture, precision, level) checks everything about that export, so that under pytest-xdist no
conversion is repeated on another worker. At the end: exporter failures, named with their cause.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import amplite
from amplite.errors import ExportError
from amplite.onnx.errors import CAUSE_LIMIT, describe, export_failure
from amplite.onnx.export import OnnxInfo, save_onnx
from amplite.onnx.verify import CPU, OnnxVerification, verify_onnx
from amplite.verify.compare import DEFAULT_TOLERANCES, run_model
from bench.bench_onnx import fp32_export, fp32_nodes, occ_baseline
from fixtures import zoo

HAS_OCC = importlib.util.find_spec("onnxconverter_common") is not None
COMBOS = [(n, p, lvl) for n in zoo.TEST_FIXTURES for p in ("fp16", "bf16") for lvl in ("O1", "O2")]
#: ONNX ops that only move data: exact in any dtype, so the exporter may place a cast on either side.
MOVEMENT = {"Slice", "Reshape", "Transpose", "Expand", "Squeeze", "Unsqueeze", "Concat", "Gather", "Identity",
            "Flatten", "Split"}
FLOAT_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
               onnx.TensorProto.BFLOAT16: "bfloat16"}


@dataclass
class Exported:
    result: amplite.ConversionResult
    info: OnnxInfo
    path: Path
    verification: OnnxVerification


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def fp32_exports() -> dict[str, onnx.ModelProto]:
    """The FP32 (un-optimised) export of each fixture, which the occ baseline converts.

    It is the export of ``result.original``, the FP32 program, the same at O1 and O2: made once per
    fixture (the O1 and O2 tests of a fixture are adjacent, so xdist usually runs them on one worker;
    where it does not, the other worker makes it again). Only the block list differs between levels.
    """
    return {}


def exported(name: str, precision: str, level: str, out_dir: Path) -> Exported:
    model, inputs = zoo.make(name)
    result = amplite.convert(model, inputs, precision=precision, level=level, verify=False)
    path = out_dir / f"{name}.{precision}.{level}.onnx"
    info = save_onnx(result.program, path, precision=precision)
    check = verify_onnx(path, run_model(model, inputs), inputs, DEFAULT_TOLERANCES[precision], provider=CPU)
    return Exported(result, info, path, check)


def precision_dtype(precision: str) -> str:
    return {"fp16": "float16", "bf16": "bfloat16"}[precision]


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    model = onnx.shape_inference.infer_shapes(model)
    vis = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    types = {vi.name: vi.type.tensor_type.elem_type for vi in vis}
    return types | {i.name: i.data_type for i in model.graph.initializer}


@pytest.mark.parametrize(("name", "precision", "level"), COMBOS, ids=["-".join(c) for c in COMBOS])
def test_fixture_exports_checks_and_runs_in_ort(
    name: str, precision: str, level: str, out_dir: Path, fp32_exports: dict[str, onnx.ModelProto]
) -> None:
    ex = exported(name, precision, level, out_dir)
    onnx.checker.check_model(str(ex.path), full_check=True)  # independent of the check save_onnx made
    model = onnx.load(str(ex.path))
    types = value_types(model)

    # Graph I/O keep the program's types (FP32 here: low-precision I/O was not requested).
    prog_inputs = [n.meta["val"] for n in ex.result.program.graph.nodes if n.op == "placeholder"
                   and n.name in ex.result.program.graph_signature.user_inputs]
    onnx_inputs = [FLOAT_TYPES.get(i.type.tensor_type.elem_type) for i in model.graph.input]
    assert onnx_inputs == [str(v.dtype).removeprefix("torch.") if v.dtype.is_floating_point else None
                           for v in prog_inputs]
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in model.graph.output)

    # Every planned compute node computes in the planned dtype (FP32 islands survive the export).
    nodes = {n.name: n for n in model.graph.node}
    matched = stashed = 0
    for entry in ex.result.report.data["plan"]:
        node = nodes.get(f"node_{entry['node']}")
        if node is None or node.op_type in MOVEMENT or entry["dtype"] not in ("float32", "float16", "bfloat16"):
            continue
        outs = [FLOAT_TYPES[types[o]] for o in node.output if types.get(o) in FLOAT_TYPES]
        if node.op_type == "LayerNormalization" and outs == [precision_dtype(precision)]:
            # the island's LayerNorm on the low dtype computes its statistics in its stash type
            stash = next((a.i for a in node.attribute if a.name == "stash_type"), 1)
            outs, stashed = [FLOAT_TYPES[stash]], stashed + 1
        if outs:
            matched += 1
            assert set(outs) == {entry["dtype"]}, (entry, node.op_type, outs)
    assert matched >= 1
    assert stashed == ex.info.cleanup["layernorm_stash"]

    # No initializer is left that is read only through Casts (it would be stored in the wrong precision).
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    for init in model.graph.initializer:
        rs = readers.get(init.name, [])
        assert not rs or not all(r.op_type == "Cast" for r in rs), init.name

    if precision == "fp16" and HAS_OCC:  # onnxconverter-common with the same FP32 islands: never fewer Casts
        if name not in fp32_exports:
            fp32_exports[name] = fp32_export(ex.result.original, optimize=False)
        baseline = occ_baseline(ex.result.original, out_dir / f"{name}.{level}.occ.onnx", fp32_nodes(ex.path),
                                fp32=fp32_exports[name])
        assert ex.info.casts == sum(1 for n in model.graph.node if n.op_type == "Cast")
        assert ex.info.casts <= baseline["casts"], (ex.info.casts, baseline)

    check = ex.verification
    assert check.provider == CPU
    if check.runnable:
        assert check.passed, [m.to_dict() for m in check.metrics]
        assert len(check.metrics) == 1
        assert (check.caveat is not None) == (precision == "fp16")  # CPU hides fp16 rounding: said so
    else:
        # ORT's CPU provider has no bf16 kernels for compute ops: named, not a crash.
        assert precision == "bf16"
        assert check.not_runnable.startswith(f"not runnable on {CPU}: ")
        assert check.unsupported_ops and all("bfloat16" in op for op in check.unsupported_ops)
        assert check.passed is None and check.to_dict()["runnable"] is False


class EncoderWithHead(nn.Module):
    """Returns the encoder states AND a head computed from them: a graph output read inside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.enc = zoo.EncoderBlock(64, 4)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.enc(self.inp(x))
        return h, self.head(h)


def _ort_loads(path: Path) -> str | None:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), opts, providers=[CPU])
    except Exception as exc:
        return str(exc)
    return None


def test_output_read_inside_graph_loads_unlike_onnxconverter_common(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, inputs = EncoderWithHead().eval(), ((torch.randn(2, 8, 16),), {})
    result = amplite.convert(model, inputs, precision="fp16", level="O1", verify=False)
    info = save_onnx(result.program, tmp_path / "enc.onnx")
    assert [dt for _, dt in info.outputs] == ["FLOAT", "FLOAT"]
    check = verify_onnx(tmp_path / "enc.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES["fp16"],
                        provider=CPU)
    assert check.passed and len(check.metrics) == 2

    float16 = pytest.importorskip("onnxconverter_common.float16")
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = torch.onnx.export(result.original, (), dynamo=True, verbose=False).model_proto
        onnx.save(float16.convert_float_to_float16(fp32, keep_io_types=True), tmp_path / "occ.onnx")
    refusal = _ort_loads(tmp_path / "occ.onnx")
    if refusal is not None:  # the known failure; if a future release fixes it, ours must still load
        assert "type" in refusal.lower()


def test_fused_contraction_runs_through_function_body(tmp_path: Path) -> None:
    """The amplite-domain nodes survive the export; plain ORT (no custom library) runs their bodies."""
    model, inputs = zoo.make("transformer")
    result = amplite.convert(model, inputs, precision="fp16", level="O2", fuse_contractions=True, verify=False)
    n_fused = sum(1 for n in result.program.graph.nodes if n.target is torch.ops.amplite.contract.default)
    assert n_fused > 0
    info = save_onnx(result.program, tmp_path / "fused.onnx")
    saved = onnx.load(str(tmp_path / "fused.onnx"))
    custom = [n for n in saved.graph.node if n.domain == "amplite"]
    assert len(custom) == n_fused == info.contract_nodes
    assert {n.op_type for n in custom} <= {f.name for f in saved.functions if f.domain == "amplite"}
    assert any(o.domain == "amplite" and o.version == 1 for o in saved.opset_import)
    assert {n.op_type for f in saved.functions for n in f.node} >= {"Cast", "Einsum", "CastLike"}
    check = verify_onnx(tmp_path / "fused.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES["fp16"],
                        provider=CPU)
    assert check.runnable and check.passed, [m.to_dict() for m in check.metrics]


@pytest.mark.parametrize("bias", [False, True])
def test_contract_body_matches_torch_op(tmp_path: Path, bias: bool) -> None:
    """One amplite.Contract node, run by ORT through its body, against the op's torch implementation."""
    from amplite.ops.contract import torch_contract

    class One(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return torch.ops.amplite.contract("bij,bkj->bik", a, b, c if bias else None, 0.5, 2.0)

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(s, generator=g).half() for s in ((2, 8, 16), (2, 4, 16), (2, 8, 4)))
    program = torch.export.export(One(), (a, b, c))
    save_onnx(program, tmp_path / "one.onnx")
    expected = torch_contract("bij,bkj->bik", a, b, c if bias else None, 0.5, 2.0)
    ref: Any = expected.float()
    check = verify_onnx(tmp_path / "one.onnx", ref, ((a, b, c), {}), DEFAULT_TOLERANCES["fp16"], provider=CPU)
    assert check.runnable and check.metrics[0].dtype == "float16"
    assert check.metrics[0].max_abs <= float(expected.abs().max()) * 2**-10  # within one fp16 rounding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_provider_verification(tmp_path: Path, precision: str) -> None:
    """On CUDA the low-precision kernels really run: no CPU caveat; bf16 runs or names its missing ops."""
    import onnxruntime as ort

    from amplite.onnx.verify import CUDA

    if CUDA not in ort.get_available_providers():  # CPU-only machines (CI): the CUDA path needs a GPU
        pytest.skip("this onnxruntime build has no CUDAExecutionProvider")
    model, inputs = zoo.make("transformer")
    result = amplite.convert(model, inputs, precision=precision, level="O2", verify=False)
    save_onnx(result.program, tmp_path / "t.onnx", precision=precision)
    check = verify_onnx(tmp_path / "t.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES[precision])
    assert check.providers_requested[0] == CUDA
    if check.provider != CUDA:  # the provider is built in but no usable GPU/driver is present
        pytest.skip(f"CUDAExecutionProvider did not start: {check.notes}")
    assert check.caveat is None
    if check.runnable:
        assert check.passed, [m.to_dict() for m in check.metrics]
    else:
        assert check.not_runnable.startswith(f"not runnable on {CUDA}: ")


class BiasedAttention(nn.Module):
    """T5's attention in miniature: SDPA with a constant float bias, then transpose → contiguous → reshape.

    torch.onnx's decomposition re-traces SDPA with a differently laid-out output, so the reshape it had
    turned into a view no longer fits ("Cannot view a tensor ..."): T5-small fails the same way.
    """

    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.qkv = nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = self.bias.unsqueeze(0).contiguous()
        if self.sdpa:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        else:
            o = torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v
        return o.reshape(b, -1, n, 4).transpose(1, 2).contiguous().reshape(b, n, -1)


def test_sdpa_followed_by_a_view_exports_and_matches(tmp_path: Path) -> None:
    """torch.onnx alone fails on this program ("Cannot view a tensor ..."); amplite's pre-ONNX rewrite
    (views to reshapes, contiguous copies after SDPA/transposes, on a copy) makes it export and run."""
    import onnxruntime as ort

    x = (torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(3)),)
    model = BiasedAttention(sdpa=True).eval()
    result = amplite.convert(model, x, precision="fp16", verify=False)
    with pytest.raises(Exception, match="Cannot view a tensor"):  # the plain exporter on the same program
        torch.onnx.export(result.program, (), dynamo=True, optimize=False, verbose=False, report=False)
    info = save_onnx(result.program, tmp_path / "m.onnx")
    session = ort.InferenceSession(info.path, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x[0].numpy()})
    expected = model(*x).detach().numpy()
    assert np.abs(got - expected).max() < 1e-2 * np.abs(expected).max()


def test_failure_message_from_a_synthetic_exception_chain() -> None:
    model, inputs = zoo.make("mlp")
    mlp_program = torch.export.export(model, *inputs)
    inner = ValueError("x" * 300 + "\nsecond line")
    middle = RuntimeError("While executing %view_4 : [num_users=1] = call_function[target=torch.ops.aten.view.default]"
                          "(args = (%t, [2, -1]), kwargs = {})")
    middle.__cause__ = inner
    outer = RuntimeError("Failed to decompose the FX graph for ONNX compatibility. \x1b[96mThis is step 2/3\x1b[0m of "
                         "exporting the model to ONNX. Next steps:\n- Create an issue")
    outer.__cause__ = middle
    inner.__context__ = outer  # a cycle must not hang the walk
    step, cause, op = describe(outer)
    assert (step, op) == ("decomposing the graph", "aten.view.default")
    assert cause.startswith("ValueError: xxx") and cause.endswith("...") and len(cause) == CAUSE_LIMIT
    err = export_failure(outer, mlp_program, {}, 20)
    assert isinstance(err, ExportError) and err.problem.startswith("ONNX export failed while decomposing the graph")
    assert err.fix == "save as .pt2 instead (--format pt2)"  # the MLP has no SDPA: no attention advice
    # the exporter's own error alone: its "Exception summary" is the cause
    alone = RuntimeError("Failed to decompose ... This is step 3/3 of exporting the model to ONNX. Next steps:\n\n"
                         "## Exception summary\n\n<class 'torch._dynamo.exc.Unsupported'>: data-dependent branch\n")
    assert describe(alone) == ("translating the graph to ONNX", "Unsupported: data-dependent branch", None)
    assert "opset 16" in str(export_failure(alone, mlp_program, {}, 16))  # old opsets are blamed first
    # A decomposition failure of an SDPA program that is not a view (GPT-2's DynamicCache constants) gets
    # no attention advice.
    sdpa_program = torch.export.export(BiasedAttention(sdpa=True).eval(), (torch.randn(1, 8, 8),))
    spec = RuntimeError("Failed to decompose the FX graph for ONNX compatibility. This is step 2/3 of exporting "
                        "the model to ONNX. Next steps:")
    spec.__cause__ = RuntimeError("SpecViolationError: Constant tensor lifted_tensor_48 is not in the constants "
                                  "dictionary.")
    err = export_failure(spec, sdpa_program, {}, 20)
    assert "lifted_tensor_48" in err.problem and err.fix == "save as .pt2 instead (--format pt2)"
    view = RuntimeError("While executing %view : [num_users=1] = call_function[target=torch.ops.aten.view.default]")
    view.__cause__ = ValueError("Cannot view a tensor with shape torch.Size([2, 8]) as a tensor with shape (16,)")
    spec.__cause__ = view
    assert "attn_implementation" in export_failure(spec, sdpa_program, {}, 20).fix
