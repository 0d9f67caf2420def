"""ONNX Cast clean-up rules, external data, low-precision I/O, opsets, and the user errors of ONNX output."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import amplite
from amplite.errors import ConfigError, EmitError, ExportError
from amplite.onnx import export as onnx_export
from amplite.onnx.cleanup import cleanup_casts
from amplite.onnx.export import save_onnx
from amplite.onnx.verify import CPU, verify_onnx
from amplite.verify.compare import DEFAULT_TOLERANCES, run_model
from fixtures import zoo

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def _model(nodes: list, inputs: list, outputs: list, inits: list | None = None) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))


def _vi(name: str, dtype: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, [2, 3])


def _run(model: ir.Model | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(proto, full_check=True)
    return ort.InferenceSession(proto.SerializeToString(), providers=[CPU]).run(None, feeds)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_exact_round_trip_removed_and_rounding_round_trip_kept() -> None:
    nodes = [
        helper.make_node("Cast", ["h"], ["h32"], to=F32),  # fp16 -> fp32 -> fp16: exact, goes
        helper.make_node("Cast", ["h32"], ["h16"], to=F16),
        helper.make_node("Relu", ["h16"], ["y"]),
        helper.make_node("Cast", ["x"], ["x16"], to=F16),  # fp32 -> fp16 -> fp32: rounds, stays
        helper.make_node("Cast", ["x16"], ["x32"], to=F32),
        helper.make_node("Relu", ["x32"], ["z"]),
    ]
    model = _model(nodes, [_vi("h", F16), _vi("x", F32)], [_vi("y", F16), _vi("z", F32)])
    x = np.array([[1.0001, 2.0, 3.0], [1e-8, 70000.0, -1.0]], dtype=np.float32)
    with np.errstate(over="ignore"):
        feeds = {"h": x.astype(np.float16), "x": x}
    before = _run(model, feeds)
    counts = cleanup_casts(model)
    assert counts["round_trip"] == 1 and counts["casts_before"] == 4 and counts["casts_after"] == 2
    assert _ops(model) == ["Relu", "Cast", "Cast", "Relu"]
    after = _run(model, feeds)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)  # bit-exact: only exact rewrites were made
    assert after[1][1, 1] == np.inf  # the fp16 overflow of the kept round trip is still there


def test_identity_and_duplicate_casts_removed_but_output_cast_kept() -> None:
    nodes = [
        helper.make_node("Cast", ["x"], ["same"], to=F32),  # identity
        helper.make_node("Cast", ["same"], ["a16"], to=F16),
        helper.make_node("Cast", ["same"], ["b16"], to=F16),  # duplicate of the one above
        helper.make_node("Add", ["a16", "b16"], ["s"]),
        helper.make_node("Cast", ["s"], ["y"], to=F16),  # identity, but a graph output: kept
    ]
    model = _model(nodes, [_vi("x", F32)], [_vi("y", F16)])
    counts = cleanup_casts(model)
    assert (counts["identity"], counts["duplicate"]) == (1, 1)
    assert _ops(model) == ["Cast", "Add", "Cast"]
    assert [v.name for v in model.graph.outputs] == ["y"]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(_run(model, {"x": x})[0], (x.astype(np.float16) * 2).astype(np.float16))


def test_cast_read_only_by_shape_is_removed_and_shared_one_rewired() -> None:
    nodes = [
        helper.make_node("Cast", ["h"], ["h32"], to=F32),  # read only by Shape: goes
        helper.make_node("Shape", ["h32"], ["s"]),
        helper.make_node("Cast", ["x"], ["x16"], to=F16),  # also read by Relu: stays, Size reads x
        helper.make_node("Size", ["x16"], ["n"]),
        helper.make_node("Relu", ["x16"], ["r"]),
    ]
    outputs = [helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
               helper.make_tensor_value_info("n", TensorProto.INT64, []), _vi("r", F16)]
    model = _model(nodes, [_vi("h", F16), _vi("x", F32)], outputs)
    feeds = {"h": np.ones((2, 3), np.float16), "x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    before = _run(model, feeds)
    counts = cleanup_casts(model)
    assert counts["shape_only"] == 1 and counts["casts_after"] == 1
    assert _ops(model) == ["Shape", "Cast", "Size", "Relu"]
    size = next(n for n in model.graph if n.op_type == "Size")
    assert size.inputs[0].name == "x"
    for b, a in zip(before, _run(model, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("to", "tdtype"), [(F16, torch.float16), (BF16, torch.bfloat16)])
def test_initializer_read_only_through_casts_is_stored_low_with_round_to_nearest_even(to: int, tdtype) -> None:
    w = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 1.0 + 2.0**-11 if to == F16 else 1.0 + 2.0**-8  # an exact tie: rounds to even (1.0)
    inits = [helper.make_tensor("w", F32, [2, 3], w.flatten().tolist()),
             helper.make_tensor("k", F32, [2, 3], [1.0] * 6)]
    nodes = [
        helper.make_node("Cast", ["w"], ["w_low"], to=to),
        helper.make_node("Cast", ["w"], ["w_low2"], to=to),
        helper.make_node("Add", ["w_low", "w_low2"], ["y"]),
        helper.make_node("Cast", ["k"], ["k_low"], to=to),  # k is also read in FP32: not folded
        helper.make_node("Add", ["k", "x"], ["z"]),
        helper.make_node("Cast", ["k_low"], ["k32"], to=F32),
        helper.make_node("Add", ["z", "k32"], ["u"]),
    ]
    model = _model(nodes, [_vi("x", F32)], [_vi("y", to), _vi("u", F32)], inits)
    counts = cleanup_casts(model)
    assert counts["initializer"] == 2
    stored = model.graph.initializers["w"]
    assert stored.dtype == ir.DataType(to) and model.graph.initializers["k"].dtype == ir.DataType.FLOAT
    got = torch.from_numpy(np.asarray(stored.const_value.numpy()).view(np.uint16).copy())
    assert torch.equal(got, w.to(tdtype).view(torch.uint16))
    assert float(w.to(tdtype)[0, 0]) == 1.0


def test_initializer_cast_after_data_movement_is_folded_exactly() -> None:
    """pos[:, :n] then Cast, or table[ids] then Cast: the table is stored low, the gathered values match."""
    table = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    inits = [helper.make_tensor("table", F32, [5, 3], table.flatten().tolist()),
             helper.make_tensor("starts", TensorProto.INT64, [1], [1]),
             helper.make_tensor("ends", TensorProto.INT64, [1], [3])]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("Cast", ["rows"], ["rows16"], to=F16),
        helper.make_node("Slice", ["table", "starts", "ends"], ["part"]),
        helper.make_node("Cast", ["part"], ["part16"], to=F16),
        helper.make_node("Add", ["rows16", "part16"], ["y"]),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2])
    model = _model(nodes, [ids], [helper.make_tensor_value_info("y", F16, [2, 3])], inits)
    feeds = {"ids": np.array([4, 0], dtype=np.int64)}
    counts = cleanup_casts(model)
    assert counts["initializer"] == 2 and counts["casts_after"] == 0
    assert model.graph.initializers["table"].dtype == ir.DataType.FLOAT16
    # The fp16 semantics exactly: round each operand, add, round. (ORT's CPU provider would drop the operand
    # roundings of the unfolded graph: it fuses the Casts with those it inserts around its FP32 Add.)
    low = table.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(_run(model, feeds)[0], (low[[4, 0]] + low[1:3]).astype(np.float16))


def test_low_initializer_read_in_fp32_is_not_widened() -> None:
    """Storing an fp16 table as FP32 would save a Cast but double its bytes: left alone."""
    inits = [helper.make_tensor("h", F16, [2, 3], [0.5] * 6)]
    nodes = [helper.make_node("Cast", ["h"], ["h32"], to=F32), helper.make_node("Add", ["h32", "x"], ["y"])]
    model = _model(nodes, [_vi("x", F32)], [_vi("y", F32)], inits)
    assert cleanup_casts(model)["initializer"] == 0
    assert model.graph.initializers["h"].dtype == ir.DataType.FLOAT16 and _ops(model) == ["Cast", "Add"]


def test_forced_external_data_two_files_checked_and_runnable(tmp_path: Path) -> None:
    model, inputs = zoo.make("mlp")
    result = amplite.convert(model, inputs, precision="fp16", level="O2", verify=False)
    info = save_onnx(result.program, tmp_path / "mlp.onnx", external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["mlp.onnx", "mlp.onnx.data"]  # no temp files left
    assert info.data_path == str(tmp_path / "mlp.onnx.data")
    data = (tmp_path / "mlp.onnx.data").stat().st_size
    assert data >= 32 * 64 * 2 + 64 * 10 * 2  # both weight matrices, fp16
    assert info.bytes == data + (tmp_path / "mlp.onnx").stat().st_size
    onnx.checker.check_model(str(tmp_path / "mlp.onnx"), full_check=True)
    check = verify_onnx(tmp_path / "mlp.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES["fp16"])
    assert check.passed


def test_low_precision_io_requested_at_export(tmp_path: Path) -> None:
    model, inputs = zoo.make("mlp")
    result = amplite.convert(model, inputs, precision="fp16", level="O2", verify=False)
    plain = save_onnx(result.program, tmp_path / "plain.onnx")
    low = save_onnx(result.program, tmp_path / "low.onnx", low_precision_io=True)
    assert [d for _, d in plain.inputs + plain.outputs] == ["FLOAT", "FLOAT"]
    assert [d for _, d in low.inputs + low.outputs] == ["FLOAT16", "FLOAT16"]
    assert low.casts == 0 < plain.casts  # the boundary casts cancel the program's own input/output casts
    check = verify_onnx(tmp_path / "low.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES["fp16"])
    assert check.passed and check.metrics[0].dtype == "float16"


def test_opset_18_keeps_amplite_functions(tmp_path: Path) -> None:
    model, inputs = zoo.make("transformer")
    result = amplite.convert(model, inputs, precision="fp16", level="O2", fuse_contractions=True, verify=False)
    info = save_onnx(result.program, tmp_path / "t.onnx", opset=18)
    saved = onnx.load(str(tmp_path / "t.onnx"))
    assert info.opset == 18 and info.contract_nodes > 0
    assert all(o.version == 18 for f in saved.functions for o in f.opset_import if o.domain == "")
    check = verify_onnx(tmp_path / "t.onnx", run_model(model, inputs), inputs, DEFAULT_TOLERANCES["fp16"])
    assert check.passed


@pytest.fixture(scope="module")
def cnn_bf16() -> torch.export.ExportedProgram:
    model, inputs = zoo.make("cnn")
    return amplite.convert(model, inputs, precision="bf16", level="O1", verify=False).program


@pytest.mark.parametrize(("opset", "words"), [(12, ["opset 12", "bfloat16 Cast"]), (20, ["opset 20", "bfloat16 Conv",
                                                                                          "--opset 22"])])
def test_opset_too_old_for_bf16(tmp_path: Path, cnn_bf16, opset: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        save_onnx(cnn_bf16, tmp_path / "m.onnx", precision="bf16", opset=opset)
    assert all(w in err.value.one_line() for w in words) and err.value.exit_code == 2
    assert os.listdir(tmp_path) == []


@torch.library.custom_op("amplite_test::no_onnx", mutates_args=())
def _no_onnx(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_onnx.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Untranslatable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.amplite_test.no_onnx(self.fc(x))


def test_op_without_onnx_translation_is_named(tmp_path: Path) -> None:
    result = amplite.convert(Untranslatable(), (torch.randn(2, 4),), precision="fp16", verify=False)
    with pytest.raises(ExportError) as err:
        save_onnx(result.program, tmp_path / "m.onnx")
    assert "amplite_test.no_onnx.default" in err.value.problem and "--format pt2" in err.value.fix
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def mlp_program() -> torch.export.ExportedProgram:
    model, inputs = zoo.make("mlp")
    return amplite.convert(model, inputs, precision="fp16", level="O2", verify=False).program


@pytest.mark.parametrize("external", [False, True])
def test_disk_full_leaves_nothing(tmp_path: Path, mlp_program, monkeypatch: pytest.MonkeyPatch, external: bool):
    real_save = ir.save

    def full(model: ir.Model, path: str | os.PathLike, **kwargs: object) -> None:
        real_save(model, path, **kwargs)  # a partial file exists when the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_export.ir, "save", full)
    with pytest.raises(EmitError) as err:
        save_onnx(mlp_program, tmp_path / "m.onnx", external_data=external)
    assert "No space left" in err.value.problem and err.value.exit_code == 2
    assert os.listdir(tmp_path) == []


def test_unwritable_destination(tmp_path: Path, mlp_program) -> None:
    with pytest.raises(EmitError):
        save_onnx(mlp_program, tmp_path / "missing" / "m.onnx")
    if os.geteuid() == 0:  # root ignores directory permissions: the read-only case cannot be set up
        pytest.skip("root can write to read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(EmitError, match="not writable"):
            save_onnx(mlp_program, ro / "m.onnx")
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


class Wide(nn.Module):
    """About 1.3 G parameters: 2.7 GB at fp16, over protobuf's 2 GB limit."""

    def __init__(self, d: int = 16384, layers: int = 5) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_over_2gb_streams_external_data_without_second_copy(tmp_path: Path) -> None:
    with torch.no_grad():
        model = Wide().eval()
        for layer in model.layers:
            layer.weight.mul_(0.01)
    inputs = ((torch.randn(1, 16384),), {})
    result = amplite.convert(model, inputs, precision="fp16", level="O2", verify=False)
    del model
    weights = sum(t.numel() * t.element_size() for t in result.program.state_dict.values())
    assert weights > 2**31
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        info = save_onnx(result.program, tmp_path / "wide.onnx")
    finally:
        done.set()
        sampler.join()
    assert info.data_path is not None and info.bytes > 2**31
    assert sorted(os.listdir(tmp_path)) == ["wide.onnx", "wide.onnx.data"]
    assert peak[0] - base < 0.5 * weights, (peak[0] - base) / weights  # never a second full copy


@pytest.mark.parametrize("opset", [16, 20])
def test_cached_registry_exports_what_torch_onnx_export_does(mlp_program, monkeypatch, opset: int) -> None:
    """The exporter's registry is built once per opset; the model is the one ``torch.onnx.export`` makes
    (16: below torchlib's opset, translated at 18 then converted, as ``torch.onnx.export`` does)."""
    from amplite.onnx import registry

    registry.cached_registry.cache_clear()
    cached = [ir.to_proto(onnx_export.export_model(mlp_program, opset=opset)) for _ in range(2)]
    assert registry.cached_registry.cache_info().misses == 1  # the second export reused the registry
    monkeypatch.setattr(onnx_export, "cached_registry", lambda *_a: None)  # the public entry point
    public = ir.to_proto(onnx_export.export_model(mlp_program, opset=opset))
    assert public.opset_import == cached[0].opset_import and any(o.version == opset for o in public.opset_import)
    graphs = {m.graph.SerializeToString() for m in [public, *cached]}
    assert len(graphs) == 1


def test_registry_falls_back_to_the_public_exporter_when_its_internals_move(mlp_program, monkeypatch) -> None:
    """A torch whose internal ``_core.export`` no longer takes amplite's keywords: no cached registry, and the
    export still works through ``torch.onnx.export``."""
    from torch.onnx._internal.exporter import _core

    from amplite.onnx import registry

    def moved(model, args=(), kwargs=None, *, registry=None):  # lost optimize/verbose/report/opset_version
        raise AssertionError("amplite must not call an exporter whose signature moved")

    registry.cached_registry.cache_clear()
    monkeypatch.setattr(_core, "export", moved)
    try:
        assert registry.cached_registry(18, ()) is None
    finally:
        registry.cached_registry.cache_clear()
    monkeypatch.undo()
    monkeypatch.setattr(onnx_export, "cached_registry", lambda *_a: None)
    model = onnx_export.export_model(mlp_program, opset=18)
    assert any(n.op_type == "Gemm" or n.op_type == "MatMul" for n in ir.to_proto(model).graph.node)
