"""Unit tests of the precision passes on small exported graphs, with numeric checks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from amplite.converter.pipeline import strip_export_checks
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import PassManager
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.graph_utils import cast_dtype, make_cast
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.meta import PRECISION_KEY
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, PrecisionPolicy
from tests.conftest import compute_dtypes, count_casts

aten = torch.ops.aten


def graph_module(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.export.export(model.eval(), args, strict=False).module()
    strip_export_checks(gm)
    return gm


def convert(gm: torch.fx.GraphModule, level: Level = Level.O1, extra: tuple = ()) -> tuple:
    policy = PrecisionPolicy("fp16", level)
    passes = [AnnotatePrecision(policy), InsertCasts(), CleanupCasts(), *extra]
    return PassManager(passes)(gm)


class SharedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.c(x).softmax(-1)


def test_one_cast_per_value_and_dtype_shared_by_all_consumers() -> None:
    x = torch.randn(4, 8)
    model = SharedInput()
    gm, records = convert(graph_module(model, x))
    casts_of_x = [n for n in gm.graph.nodes if cast_dtype(n) == torch.float16 and n.args[0].name == "x"]
    assert len(casts_of_x) == 1
    assert len(casts_of_x[0].users) == 3  # a, b and c all read the one fp16 copy of x
    assert records[1].counters["casts_shared"] >= 2
    assert compute_dtypes(gm.graph, aten.linear) == [torch.float16] * 3
    assert compute_dtypes(gm.graph, aten.softmax) == [torch.float32]
    torch.testing.assert_close(gm(x), model(x), atol=5e-3, rtol=5e-3)


def test_annotation_records_reasons_and_does_not_change_the_graph() -> None:
    gm = graph_module(SharedInput(), torch.randn(4, 8))
    before = str(gm.graph)
    result = AnnotatePrecision(PrecisionPolicy("fp16", Level.O1))(gm)
    assert not result.modified and str(gm.graph) == before
    reasons = {n.name: n.meta[PRECISION_KEY]["reason"] for n in gm.graph.nodes if PRECISION_KEY in n.meta}
    assert reasons["softmax"] == "fp32-list:softmax"
    assert reasons["linear"] == "low-list:linear"
    assert reasons["add"] == "follow-inputs"


class Decomposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_decomposed_norm_stays_fp32_at_o2() -> None:
    x = torch.randn(4, 16)
    gm, _ = convert(graph_module(Decomposed(), x), Level.O2)
    for op in (aten.pow, aten.mean, aten.rsqrt):
        assert compute_dtypes(gm.graph, op) == [torch.float32], op
    # `+ eps` sits between two FP32 ops: it stays FP32 instead of costing two casts and a rounding.
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert add.meta[PRECISION_KEY]["reason"] == "fp32-island-bridge"
    assert cast_dtype(add.args[0]) is None and all(cast_dtype(u) is None for u in add.users)
    torch.testing.assert_close(gm(x), Decomposed()(x), atol=2e-3, rtol=2e-3)


class Chain(nn.Module):
    """x -> fp16 -> fp32 (exact) -> fp16 again, and x -> fp16 -> fp32 (lossy round trip)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.half()
        exact = h.float().half()  # fp16 -> fp32 -> fp16: exact, can fold to h
        lossy = x.half().float()  # fp32 -> fp16 -> fp32: rounding, must stay
        return exact, lossy


def test_cleanup_folds_exact_round_trips_but_keeps_lossy_ones() -> None:
    x = torch.randn(64) * 3
    gm = graph_module(Chain(), x)
    ref = Chain()(x)
    result = CleanupCasts()(gm)
    gm.recompile()
    exact, lossy = gm(x)
    assert result.counters["round_trips_folded"] == 1
    assert result.counters["duplicates_merged"] == 1  # the two x.half() calls
    assert torch.equal(exact, ref[0]) and exact.dtype == torch.float16
    assert torch.equal(lossy, ref[1])  # still rounded through fp16
    assert not torch.equal(lossy, x)


class Expand(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(64, 8).half()


class Slice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()[:2]


def test_casts_move_to_the_smaller_side_of_data_movement() -> None:
    x = torch.randn(1, 8)
    gm = graph_module(Expand(), x)
    result = CleanupCasts()(gm)
    gm.recompile()
    assert result.counters["moved_above_data_movement"] == 1
    (cast,) = [n for n in gm.graph.nodes if cast_dtype(n) is not None]
    assert cast.args[0].op == "placeholder"  # casts 8 elements, not 512
    assert torch.equal(gm(x), Expand()(x))

    y = torch.randn(100, 8)
    gm = graph_module(Slice(), y)
    result = CleanupCasts()(gm)
    gm.recompile()
    assert result.counters["moved_below_data_movement"] == 1
    (cast,) = [n for n in gm.graph.nodes if cast_dtype(n) is not None]
    assert cast.args[0].target is aten.slice.Tensor
    assert torch.equal(gm(y), Slice()(y))


def test_identity_cast_is_removed() -> None:
    gm = graph_module(nn.Linear(4, 4), torch.randn(2, 4))
    lin = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    with gm.graph.inserting_before(lin):
        ident = make_cast(gm.graph, lin.args[0], torch.float32)
    lin.args = (ident, *lin.args[1:])
    gm.recompile()
    result = CleanupCasts()(gm)
    assert result.counters["identity_removed"] == 1 and count_casts(gm.graph) == 0


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.lin(x))


def test_store_low_params_keeps_fp32_readers_fp32_and_never_touches_the_model() -> None:
    model = Mixed().eval()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    gm, records = convert(graph_module(model, x), Level.O2, (StoreLowPrecisionParams(),))
    assert gm.lin.weight.dtype == torch.float16 and gm.lin.bias.dtype == torch.float16
    assert gm.ln.weight.dtype == torch.float32  # norm parameters stay FP32
    assert records[-1].counters["tensors_stored_low"] == 2
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, snapshot[k]), k
    torch.testing.assert_close(gm(x), model(x), atol=1e-2, rtol=1e-2)


def test_graph_outputs_keep_their_dtype_unless_low_io() -> None:
    gm, _ = convert(graph_module(nn.Linear(8, 8), torch.randn(2, 8)))
    assert gm(torch.randn(2, 8)).dtype == torch.float32
    gm = graph_module(nn.Linear(8, 8), torch.randn(2, 8))
    policy = PrecisionPolicy("fp16", Level.O1)
    gm, _ = PassManager([AnnotatePrecision(policy), InsertCasts(low_precision_io=True), CleanupCasts()])(gm)
    assert gm(torch.randn(2, 8)).dtype == torch.float16


class Tied(nn.Module):
    """An LM-style model whose output head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def test_tied_weights_stay_tied_and_are_stored_low_once() -> None:
    import amplite

    model = Tied().eval()
    ids = torch.randint(0, 100, (2, 8))
    result = amplite.convert(model, (ids,), level="O2")
    state = result.program.state_dict
    low = [v for v in state.values() if v.dtype == torch.float16]
    assert low and all(v.dtype == torch.float16 for v in state.values())
    assert result.report.data["weights"]["ratio"] <= 0.5
    assert model.embed.weight.dtype == torch.float32 and model.head.weight is model.embed.weight
    assert result.passed


class ConvBnTwice(nn.Module):
    """conv1 → bn1 folds; conv2's output is also returned, so bn2 cannot be folded into it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, bias=False), nn.BatchNorm2d(8)
        for bn in (self.bn1, self.bn2):
            with torch.no_grad():
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
                bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        return self.bn2(y), y


def test_fold_batchnorm_removes_foldable_norms_exactly() -> None:
    from amplite.passes.fold_batchnorm import FoldBatchNorm

    model = ConvBnTwice().eval()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    gm = graph_module(model, x)
    result = FoldBatchNorm()(gm)
    gm.recompile()
    assert result.counters["folded"] == 1 and result.counters["kept:input-not-a-single-use-conv"] == 1
    assert len([n for n in gm.graph.nodes if n.target is aten.batch_norm.default]) == 1
    for got, want in zip(gm(x), model(x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def test_folding_removes_the_fp32_islands_around_convs() -> None:
    import amplite
    from fixtures.zoo import make

    model, inputs = make("cnn")
    folded = amplite.convert(model, inputs, level="O2")
    kept = amplite.convert(model, inputs, level="O2", fold_batchnorm=False)
    assert folded.passed and kept.passed
    assert not [n for n in folded.program.graph.nodes if n.target is aten.batch_norm.default]
    assert folded.report.data["graph"]["after"]["casts"] < kept.report.data["graph"]["after"]["casts"]
    assert folded.report.data["weights"]["ratio"] <= kept.report.data["weights"]["ratio"]


def test_o1_stores_folded_constants_low_but_keeps_user_weights_fp32() -> None:
    import amplite
    from fixtures.zoo import make
    from tests.zoo_models import _random_bn_stats

    model, inputs = make("cnn")
    model = _random_bn_stats(model)  # at its init BatchNorm's scale is 1 in fp16: it goes into the weight
    result = amplite.convert(model, inputs, level="O1")
    state = result.program.state_dict
    folded = {k: v for k, v in state.items() if "amplite_folded_" in k}
    user = {k: v for k, v in state.items() if "amplite_folded_" not in k}
    # the conv's copied weight and bias are read low only; the BatchNorm's scale and shift by the FP32 mul/add
    # after each conv (O1 keeps the affine map FP32, as autocast's BatchNorm computes it)
    assert folded and {k.rpartition("_")[2]: v.dtype for k, v in folded.items()} == {
        "weight": torch.float16, "bias": torch.float16, "scale": torch.float32, "shift": torch.float32}
    assert user and all(v.dtype == torch.float32 for v in user.values())  # O1: the user's weights stay FP32
    # Each conv reads its folded weight and bias directly: no cast node in front of them.
    convs = [n for n in result.program.graph.nodes if n.target is aten.conv2d.default]
    assert convs and all(a.op == "placeholder" for c in convs for a in c.args[1:3])
    unfused = amplite.convert(model, inputs, level="O1", fold_batchnorm=False)
    torch.testing.assert_close(result.module()(*inputs[0]), unfused.module()(*inputs[0]), atol=2e-2, rtol=2e-2)
    assert result.passed


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gamma = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) * self.gamma  # mul and add mix the fp16 linear output with FP32 tensors


def test_mixed_dtype_elementwise_ops_promote_in_kernel_without_a_cast() -> None:
    import amplite

    model = Residual()
    x = torch.randn(4, 16)
    result = amplite.convert(model, (x,), level="O1")
    graph = result.program.graph
    mul = next(n for n in graph.nodes if n.target is aten.mul.Tensor)
    dtypes = sorted(str(a.meta["val"].dtype) for a in mul.args)
    assert dtypes == ["torch.float16", "torch.float32"]  # the fp16 linear output is read as it is
    assert mul.args[0].target is aten.linear.default
    assert count_casts(graph) == 3  # x, fc.weight and fc.bias to fp16; nothing back to FP32
    counters = next(p for p in result.report.data["passes"] if p["name"] == "insert_casts")["counters"]
    assert counters["promotions_in_kernel"] == 1
    with torch.no_grad():
        want = x + F.linear(x.half(), model.fc.weight.half(), model.fc.bias.half()).float() * model.gamma
    assert torch.equal(result.module()(x), want)  # exactly the explicit-cast result
