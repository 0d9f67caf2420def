"""Tests added for mutants that survived ``make mutate`` (docs/testing.md lists them by module).

Each test pins a behaviour the rest of the suite reached but did not check: exact user-facing messages
(the one-line error promise), pattern scoping, small helpers' edge cases.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amplite.ops  # registers amplite::contract
from amplite.converter.calibration import collect_ranges
from amplite.converter.pipeline import strip_export_checks
from amplite.errors import ConfigError
from amplite.ops import cutensor_backend
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.base import PassManager
from amplite.passes.cleanup_casts import CleanupCasts
from amplite.passes.fold_batchnorm import FoldBatchNorm
from amplite.passes.fuse_contractions import FuseContractions
from amplite.passes.graph_utils import cast_dtype
from amplite.passes.insert_casts import InsertCasts
from amplite.passes.range_guard import RangeGuard, RangeRules
from amplite.passes.store_low_params import StoreLowPrecisionParams
from amplite.policy import Level, Override, PrecisionPolicy, resolve_level
from amplite.verify.criteria import Criterion, parse_tolerance

contract_mod = importlib.import_module("amplite.ops.contract")  # amplite.ops.contract is also the op
aten = torch.ops.aten
CONTRACT = torch.ops.amplite.contract.default
ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# policy


@pytest.mark.parametrize(
    ("pattern", "op", "module", "node", "hit"),
    [
        ("op:linear", "add.Tensor", "", "linear", False),  # an op: pattern never matches node names
        ("op:linear", "linear.default", "", "x", True),
        ("op:linear.default", "linear.default", "", "x", True),
        ("module:enc", "enc.Tensor", "dec", "enc", False),  # nor a module: pattern ops or nodes
        ("module:enc", "add.Tensor", "enc", "x", True),
        ("module:enc.*", "add.Tensor", "enc", "x", True),  # the module itself
        ("module:enc.*", "add.Tensor", "encoder", "x", False),
        ("node:mul_1", "mul_1", "mul_1", "x", False),  # nor a node: pattern ops or modules
        ("node:mul_*", "mul.Tensor", "", "mul_1", True),
        ("linear", "linear.default", "", "x", True),  # unprefixed: op, module or node, any one
        ("enc", "add.Tensor", "enc", "x", True),
        ("mul_1", "add.Tensor", "", "mul_1", True),
        ("enc", "add.Tensor", "", "x", False),  # no module: an empty path matches nothing
    ],
)
def test_override_patterns_match_only_what_their_prefix_names(
    pattern: str, op: str, module: str, node: str, hit: bool
) -> None:
    assert Override("keep_fp32", pattern).matches(op, module, node) is hit, (pattern, op, module, node)


def test_override_kind_and_glob() -> None:
    assert (Override("keep_fp32", "op:softmax").kind, Override("keep_fp32", "op:softmax").glob) == ("op", "softmax")
    assert (Override("keep_fp32", "enc:x").kind, Override("keep_fp32", "enc:x").glob) == ("any", "enc:x")


@pytest.mark.parametrize(
    ("text", "level"), [("0", Level.O0), ("1", Level.O1), ("2", Level.O2), ("3", Level.O3), (" o2 ", Level.O2)]
)
def test_level_accepts_digits_and_lower_case(text: str, level: Level) -> None:
    assert resolve_level(text) is level


def test_level_errors_name_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_level("O9")
    assert info.value.one_line() == "unknown level 'O9' (from --level) — fix: use one of O0, O1, O2, O3"
    monkeypatch.setenv("AMPLITE_LEVEL", "fast")
    with pytest.raises(ConfigError) as info:
        resolve_level(None)
    assert info.value.one_line() == "unknown level 'fast' (from AMPLITE_LEVEL) — fix: use one of O0, O1, O2, O3"
    monkeypatch.setenv("AMPLITE_LEVEL", "")
    assert resolve_level(None) is Level.O1  # an empty variable is unset
    assert resolve_level(Level.O3) is Level.O3


# criteria


def test_unscoped_criterion_applies_to_every_output() -> None:
    c = Criterion("sqnr_db", ">=", 40.0)
    assert c.applies_to("output") and c.applies_to("output['logits']") and c.applies_to("output[3]")
    scoped = Criterion("sqnr_db", ">=", 40.0, "logits")
    assert scoped.applies_to("output['logits']") and not scoped.applies_to("output['hidden']")


def test_unknown_precision_in_tolerance_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_tolerance([], "fp8")
    assert info.value.one_line() == "unknown precision 'fp8' — fix: use fp16 or bf16"


# ops


def test_nvmath_version_reads_the_distribution_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def version(name: str) -> str:
        asked.append(name)
        return "1.2.3"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cutensor_backend.nvmath_version() == "1.2.3" and asked == ["nvmath-python"]

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cutensor_backend.nvmath_version() == "?"


@pytest.mark.parametrize(("ptr", "align"), [(0, 256), (1, 1), (6, 2), (4096 + 128, 128), (512, 256), (256, 256)])
def test_pointer_alignment_is_the_lowest_set_bit_capped_at_256(ptr: int, align: int) -> None:
    assert cutensor_backend._alignment(types.SimpleNamespace(data_ptr=lambda: ptr)) == align


def test_contract_is_registered() -> None:
    assert amplite.ops is not None and hasattr(torch.ops.amplite, "contract")


# store_low_params


class _Mixed(nn.Module):
    """A Linear (stored low at O2), a buffer read only through a cast, a frozen weight and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.ln = nn.LayerNorm(8)
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.frozen(self.lin(x) * self.scale))


def _o2(model: nn.Module, x: torch.Tensor, prefix: str | None = None) -> tuple[torch.fx.GraphModule, dict]:
    gm = torch.export.export(model.eval(), (x,), strict=False).module()
    strip_export_checks(gm)
    policy = PrecisionPolicy("fp16", Level.O2)
    gm, records = PassManager(
        [AnnotatePrecision(policy), InsertCasts(), CleanupCasts(), StoreLowPrecisionParams(prefix)]
    )(gm)
    return gm, records[-1].counters


def test_store_low_keeps_kinds_requires_grad_and_counts() -> None:
    model, x = _Mixed(), torch.randn(3, 8)
    gm, counters = _o2(model, x)
    assert gm.lin.weight.dtype == gm.scale.dtype == gm.frozen.weight.dtype == torch.float16
    assert isinstance(gm.lin.weight, nn.Parameter) and gm.lin.weight.requires_grad
    assert isinstance(gm.frozen.weight, nn.Parameter) and not gm.frozen.weight.requires_grad
    assert "scale" in gm._buffers and not isinstance(gm.scale, nn.Parameter), "a buffer stays a buffer"
    assert gm.ln.weight.dtype == gm.ln.bias.dtype == torch.float32
    n_low = 64 + 8 + 8 + 64  # lin.weight, lin.bias, scale, frozen.weight
    assert counters == {"tensors_stored_low": 4, "casts_removed": 4, "bytes_saved": n_low * 2, "aliases_kept_tied": 0}
    for node in gm.graph.nodes:  # the readers' example values carry the stored dtype
        if node.op == "get_attr" and not node.target.startswith("ln."):
            assert node.meta["val"].dtype == torch.float16, node.target
    assert not [n for n in gm.graph.nodes if cast_dtype(n) is not None and n.args[0].op == "get_attr"]
    torch.testing.assert_close(gm(x), model(x), atol=2e-2, rtol=2e-2)
    assert model.lin.weight.dtype == torch.float32 and model.scale.dtype == torch.float32


def test_store_low_with_a_prefix_touches_only_matching_tensors() -> None:
    gm, counters = _o2(_Mixed(), torch.randn(3, 8), prefix="lin.")
    assert gm.lin.weight.dtype == gm.lin.bias.dtype == torch.float16
    assert gm.scale.dtype == gm.frozen.weight.dtype == torch.float32
    assert counters["tensors_stored_low"] == 2


class _Float64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8, dtype=torch.float64))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.w.to(torch.float16)


def test_store_low_leaves_non_fp32_tensors_alone() -> None:
    gm, counters = _o2(_Float64(), torch.randn(2, 8))
    assert gm.w.dtype == torch.float64, "only FP32 tensors are stored low"
    assert counters["tensors_stored_low"] == 2


# range_guard


class _BigButSafeWeight(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.fill_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _guard(model: nn.Module, x: torch.Tensor, rules: RangeRules, dtype: torch.dtype = torch.float16) -> tuple:
    gm = torch.export.export(model.eval(), (x,), strict=False).module()
    strip_export_checks(gm)
    result = RangeGuard(collect_ranges(gm, [((x,), {})]), rules, dtype)(gm)
    flags = {n.name: n.meta["amplite_range"] for n in gm.graph.nodes if "amplite_range" in n.meta}
    return flags, result


def test_weights_are_not_activations_and_the_weight_limit_is_a_strict_bound() -> None:
    x = torch.full((2, 4), 1e-3)
    flags, result = _guard(_BigButSafeWeight(1000.0), x, RangeRules())  # |w| = 1000 > data_max, < 65504
    assert flags == {} and not result.modified and result.counters == {}, flags
    flags, _ = _guard(_BigButSafeWeight(1000.0), x, RangeRules(weight_max=1000.0))
    assert flags == {}, "|w| equal to weight_max is allowed"
    flags, result = _guard(_BigButSafeWeight(1000.0), x, RangeRules(weight_max=999.0))
    assert flags == {"linear": "range:weight-overflow fc.weight |w|=1e+03"}, flags
    assert result.counters == {"kept_fp32:range:weight-overflow": 1}


def test_activation_limit_is_strict_and_names_output_or_input() -> None:
    x = torch.full((2, 4), 0.25)
    model = _BigButSafeWeight(1.0)  # y = 1.0 exactly
    assert _guard(model, x, RangeRules(data_max=1.0))[0] == {}
    flags, result = _guard(model, x, RangeRules(data_max=0.5))
    assert flags == {"linear": "range:activation output |x|=1>0.5"}, flags
    assert result.counters == {"kept_fp32:range:activation": 1}
    flags, _ = _guard(model, x, RangeRules(data_max=0.25))
    assert flags["linear"] == "range:activation output |x|=1>0.25"
    flags, _ = _guard(_BigButSafeWeight(1e-3), x * 4, RangeRules(data_max=0.5))  # y = 4e-3, x = 1
    assert flags == {"linear": "range:activation input x |x|=1>0.5"}, "the input is named when it is too large"
    assert _guard(model, x * 1e4, RangeRules(data_max=1.0), torch.bfloat16)[0] == {}, "bf16: no activation rule"


class _Underflow(nn.Module):
    def __init__(self, tiny: int, shape: tuple[int, int] = (20, 10)) -> None:
        super().__init__()
        self.fc = nn.Linear(shape[1], shape[0], bias=False)
        with torch.no_grad():
            w = self.fc.weight.view(-1)
            w.fill_(0.5)
            w[:tiny] = -1e-9  # flushes to zero in fp16 (negative: the share is of magnitudes)
            w[-10:] = 0.0  # zeros are not counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_underflow_share_is_of_the_non_zero_weights_and_strict() -> None:
    x = torch.rand(2, 10)
    assert _guard(_Underflow(1), x, RangeRules())[0] == {}  # 1 of 190 non-zero weights: 0.5 % <= 1 %
    flags, result = _guard(_Underflow(2), x, RangeRules())  # 2 / 190 = 1.05 %
    assert flags == {"linear": "range:weight-underflow fc.weight 1.1% flush to zero"}, flags
    assert result.counters == {"kept_fp32:range:weight-underflow": 1}
    assert _guard(_Underflow(2), x, RangeRules(underflow_share=2 / 190))[0] == {}, "a share equal to the limit is kept"
    assert _guard(_Underflow(2), x, RangeRules(), torch.bfloat16)[0] == {}, "bf16: no weight rules"


def test_underflow_share_of_a_large_weight_is_estimated_on_a_sample() -> None:
    shape = (1024, 1025)  # 1_049_600 values: more than the 2^20 sampled
    flags, _ = _guard(_Underflow(600_000, shape), torch.rand(1, 1025), RangeRules())
    assert flags["linear"].startswith("range:weight-underflow fc.weight 57."), flags


# --- fusion passes: fold_batchnorm, fuse_contractions, contraction rules, einsum equations, cutensor ---


def _export(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.export.export(model.eval(), args, strict=False).module()
    strip_export_checks(gm)
    return gm


def _fuse(model: nn.Module, *args: torch.Tensor, **kw: object) -> tuple[torch.fx.GraphModule, dict]:
    gm = _export(model, *args)
    ref = model(*args)
    res = FuseContractions(dtypes=ALL_FLOATS, **kw)(gm)
    gm.recompile()
    torch.testing.assert_close(gm(*args), ref, rtol=1e-5, atol=1e-5)
    return gm, {k: v for k, v in res.counters.items() if v}


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


def test_linear_of_a_vector_and_without_bias_is_fused() -> None:
    w = torch.randn(5, 4)
    _, counters = _fuse(_Fn(lambda v: F.linear(v, w) * 0.5), torch.randn(4))
    assert counters.get("fused:linear") == 1, counters
    _, counters = _fuse(_Fn(lambda x: F.linear(x.transpose(0, 1), w)), torch.randn(4, 3))
    assert counters.get("fused:linear") == 1, counters


def test_addmm_defaults_alpha_and_beta_to_one() -> None:
    c, a, b = torch.randn(3, 5), torch.randn(4, 3), torch.randn(4, 5)
    _, counters = _fuse(_Fn(lambda c, a, b: torch.addmm(c, a.t(), b)), c, a, b)
    assert counters.get("fused:addmm") == 1, counters


@pytest.mark.parametrize("equation", ["ij, jk -> ik", "ij,jk"])
def test_einsum_with_spaces_or_implicit_output_is_fused(equation: str) -> None:
    _, counters = _fuse(_Fn(lambda a, b: torch.einsum(equation, a.t(), b)), torch.randn(3, 4), torch.randn(3, 5))
    assert counters.get("fused:einsum") == 1, counters


def test_a_bias_that_broadcasts_the_result_is_not_absorbed() -> None:
    gm, counters = _fuse(_Fn(lambda x, w, b: (x.t() @ w) + b), torch.randn(8, 4), torch.randn(8, 1), torch.randn(4, 6))
    # fused, the add left alone, with its reason recorded
    assert counters == {"fused:matmul": 1, "absorbed:transpose": 1, "rejected:bias_broadcasts_output": 1}, counters
    assert aten.add.Tensor in [n.target for n in gm.graph.nodes]


def test_squeeze_in_a_chain_is_absorbed() -> None:
    _, counters = _fuse(_Fn(lambda a, b: a.squeeze(1).t() @ b), torch.randn(3, 1, 4), torch.randn(3, 5))
    assert (
        counters.get("fused:matmul") == 1
        and counters.get("absorbed:squeeze", 0) + counters.get("absorbed:view", 0) >= 1
    ), counters
    _, counters = _fuse(_Fn(lambda a, b: a.squeeze().t() @ b), torch.randn(3, 1, 4), torch.randn(3, 5))
    assert counters.get("fused:matmul") == 1, counters


# fold_batchnorm


class _ConvBn(nn.Module):
    def __init__(self, bias: bool, affine: bool = True) -> None:
        super().__init__()
        # padding=1 makes export keep the bias argument (None when bias=False) in the conv's args
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.BatchNorm2d(4, affine=affine)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


@pytest.mark.parametrize(("bias", "affine"), [(False, True), (True, False)])
def test_conv_without_bias_and_bn_without_affine_fold(bias: bool, affine: bool) -> None:
    model, x = _ConvBn(bias, affine).eval(), torch.randn(2, 3, 8, 8)
    gm = _export(model, x)
    result = FoldBatchNorm()(gm)
    gm.recompile()
    assert result.counters["folded"] == 1, result.counters
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


class _BnFromInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), mean, self.var, training=False)


def test_batchnorm_with_statistics_from_an_input_is_kept() -> None:
    gm = _export(_BnFromInput(), torch.randn(1, 3, 6, 6), torch.zeros(4))
    assert FoldBatchNorm()(gm).counters == {"kept:non-constant-parameters": 1}


# cutensor backend (CPU fake of nvmath)


class _Plan:
    made: ClassVar[list[_Plan]] = []

    def __init__(self, expr, a, b, *, c=None, out=None, stream=None) -> None:
        self.expr, self.has_c, self.calls = expr, c is not None, []
        self.ops = {"a": a, "b": b, "c": c, "out": out}
        _Plan.made.append(self)

    def plan(self, stream=None) -> None:
        pass

    def reset_operands(self, **kw) -> None:
        self.calls.append(kw)
        self.ops.update({k: v for k, v in kw.items() if k != "stream"})

    def execute(self, *, alpha=1.0, beta=None, release_workspace=False, stream=None):
        o = self.ops
        res = alpha * torch.einsum(self.expr, o["a"].float(), o["b"].float())
        if self.has_c:
            res = res + beta * o["c"].float()
        o["out"].copy_(res)


@pytest.fixture
def fake_nvmath(monkeypatch: pytest.MonkeyPatch):
    mod = types.ModuleType("nvmath")
    mod.tensor = types.SimpleNamespace(BinaryContraction=_Plan)
    monkeypatch.setitem(sys.modules, "nvmath", mod)
    monkeypatch.setattr(cutensor_backend, "_alignment", lambda t: 256)
    cutensor_backend.clear_cache()
    _Plan.made = []
    yield
    cutensor_backend.clear_cache()


def test_full_size_bias_goes_in_as_c_and_operands_are_unbound(fake_nvmath: None) -> None:
    a, b, c = torch.randn(4, 3).half(), torch.randn(3, 5).half(), torch.randn(4, 5).half()
    out = cutensor_backend.contract("mk,kn->mn", a, b, c, 1.0, 2.0)
    torch.testing.assert_close(out.float(), a.float() @ b.float() + 2 * c.float(), rtol=2e-3, atol=2e-3)
    (plan,) = _Plan.made
    assert plan.has_c, "a full-size bias is cuTENSOR's C, not a separate add"
    assert plan.ops == {"a": None, "b": None, "c": None, "out": None}, "cached plans must not keep tensors alive"
    assert all("stream" in call for call in plan.calls), "operands are (un)bound on the current stream"
    cutensor_backend.contract("mk,kn->mn", a, b, c, 1.0, 0.0)  # beta = 0: no C at all
    assert not _Plan.made[-1].has_c and len(_Plan.made) == 2
    assert amplite.ops is not None and CONTRACT is not None


def test_folded_tensors_get_static_fake_values() -> None:
    model, x = _ConvBn(True).eval(), torch.randn(2, 3, 8, 8)
    gm = _export(model, x)
    FoldBatchNorm()(gm)
    folded = [n for n in gm.graph.nodes if n.op == "get_attr" and "amplite_folded_" in n.target]
    assert len(folded) == 2
    for node in folded:
        val = node.meta["val"]
        assert hasattr(val, "fake_mode") and all(isinstance(s, int) for s in val.shape), node.target


# --- einsum modes, graph helpers, annotate_precision bridges, verification batches ---


def test_unsqueeze_and_dims_outside_the_rank_are_not_fusable() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    op = Operand.from_shape(ModeTable(), [2, 3])
    with pytest.raises(NotFusable) as info:
        op.unsqueeze(3)  # valid: -3 <= d < 3
    assert (info.value.reason, info.value.detail) == ("bad_dim", "3 for rank 2")
    op.unsqueeze(-3)
    assert len(op.dims) == 3 and op.dims[0] == []


def test_source_line_is_the_last_user_frame() -> None:
    from amplite.passes.graph_utils import source_line

    trace = "\n".join(
        [
            '  File "/home/me/model.py", line 12, in forward',
            '  File "/home/me/broken.py" (no number)',
            '  File "/home/me/block.py", line 40, in forward',
            '  File "/usr/lib/python3/site-packages/torch/nn/modules/module.py", line 1, in _call_impl',
            "    return forward_call(*args)",
        ]
    )
    assert source_line(types.SimpleNamespace(meta={"stack_trace": trace})) == "/home/me/block.py:40"
    assert source_line(types.SimpleNamespace(meta={})) == ""


class _EpsBeforeOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1, keepdim=True) + 1e-6  # the add feeds the graph output, not an FP32 op


class _ConstantBetweenNorms(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1) * torch.arange(4.0).exp()  # arange: no floating operand at all


def test_only_nodes_between_fp32_ops_are_bridges() -> None:
    gm = _export(_EpsBeforeOutput(), torch.randn(2, 4))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert add.meta["amplite_precision"]["reason"] == "level:O2", "an add that feeds the output is no bridge"
    gm = _export(_ConstantBetweenNorms(), torch.randn(2, 4))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    arange = next(n for n in gm.graph.nodes if "arange" in str(n.target))
    reason = arange.meta["amplite_precision"]["reason"]
    assert reason == "no-float-operands", "a node without float operands is no bridge"


def test_batches_are_stacked_by_rows_of_the_last_dimension() -> None:
    from amplite.verify.compare import DEFAULT_TOLERANCES, compare_batches

    g = torch.Generator().manual_seed(7)
    refs = [torch.randn(2, 3, 5, generator=g).double() for _ in range(2)]
    outs = [r.clone() for r in refs]
    outs[1][1, 2] = -outs[1][1, 2]  # one row of 5 logits (of 12) flips its top class
    (m,) = compare_batches(list(zip(refs, outs, strict=True)), DEFAULT_TOLERANCES["fp16"])
    assert m.batches == 2 and m.shape == [2, 3, 5]
    assert m.top1 == pytest.approx(11 / 12), "top-1 is over rows of the last dimension of every batch"
    # Batches whose last dimensions differ are judged as one flat vector.
    pairs = [(torch.ones(2, 3), torch.ones(2, 3)), (torch.ones(2, 4), torch.ones(2, 4))]
    (flat,) = compare_batches(pairs, DEFAULT_TOLERANCES["fp16"])
    assert flat.passed and flat.sqnr_db == float("inf") and flat.shape == [2, 3]


def test_empty_override_pattern_message() -> None:
    from amplite.policy import make_overrides

    with pytest.raises(ConfigError) as info:
        make_overrides(keep_fp32=["op:"])
    assert info.value.one_line() == "empty override pattern 'op:' — fix: write e.g. module:encoder.*"


def test_verification_edge_cases() -> None:
    from amplite.verify.compare import DEFAULT_TOLERANCES, json_float, tensor_metrics

    fp16 = DEFAULT_TOLERANCES["fp16"]
    assert [json_float(v) for v in (float("inf"), -float("inf"), float("nan"), 1.5)] == ["inf", "-inf", "nan", 1.5]
    shape = tensor_metrics("o", torch.ones(2, 3), torch.ones(3, 2), fp16)
    assert not shape.passed and shape.notes == ["shape differs: converted [3, 2]"]
    empty = tensor_metrics("o", torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), fp16)
    assert empty.mismatch == 0.0 and empty.passed, "an empty integer output has no mismatch"
    vec = tensor_metrics("o", torch.tensor([0.1, 2.0, 0.3]), torch.tensor([0.1, 0.2, 0.3]), fp16)
    assert vec.top1 == 0.0, "a 1-D output is one row of classes"
    # No finite value to compare fails even when the user's criteria would hold for the defaults.
    tol = parse_tolerance(["max_abs<=1", "nonfinite<=100"])
    none = tensor_metrics("o", torch.ones(4), torch.full((4,), float("inf")), tol)
    assert not none.passed and "no finite values to compare" in none.notes


def test_expand_to_fewer_dimensions_is_not_fusable() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    table = ModeTable()
    op = Operand.from_shape(table, [2, 1])
    with pytest.raises(NotFusable) as info:
        op.expand_to(table, [3])
    assert (info.value.reason, info.value.detail) == ("bad_expand", "[3]")
    with pytest.raises(NotFusable) as info:
        op.expand_to(table, [3, 4])
    assert (info.value.reason, info.value.detail) == ("bad_expand", "2 -> 3")
    op.expand_to(table, [5, 2, 4])
    assert op.shape(table) == [5, 2, 4]


class _Reductions(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(-1), x.softmax(0), x.cumsum(-1), x.amax(-1)


def test_only_reductions_deeper_than_the_limit_are_flagged() -> None:
    x = torch.rand(3, 16)
    flags, result = _guard(_Reductions(), x, RangeRules(data_max=1e9, max_reduction_depth=4))
    # softmax(0) runs over 3 values; amax is a normaliser, not a reduction table entry
    assert flags == {"sum_1": "range:reduction-depth 16>4", "cumsum": "range:reduction-depth 16>4"}, flags
    assert result.counters == {"kept_fp32:range:reduction-depth": 2}
    flags, _ = _guard(_Reductions(), x, RangeRules(data_max=1e9, max_reduction_depth=2))
    assert flags["softmax"] == "range:reduction-depth 3>2", "softmax's depth is the size of its dim"
    assert _guard(_Reductions(), x, RangeRules(data_max=1e9, max_reduction_depth=16))[0] == {}, "16 is allowed"
    assert _guard(_Reductions(), x, RangeRules(data_max=1e9, max_reduction_depth=None))[0] == {}


def test_squeeze_of_one_dim_keeps_the_other_unit_dims() -> None:
    _, counters = _fuse(_Fn(lambda a, b: a.squeeze(1) @ b), torch.randn(1, 1, 4), torch.randn(4, 5))
    assert counters.get("fused:matmul") == 1, counters


class _Detailed:
    name = "detailed"

    def __call__(self, gm: torch.fx.GraphModule) -> object:
        return types.SimpleNamespace(graph_module=gm, modified=False, counters={"n": 1}, details={"why": ["x"]})


def test_pass_manager_keeps_details_and_store_low_reports_modified() -> None:
    gm = _export(nn.Linear(2, 2), torch.randn(1, 2))
    _, (record,) = PassManager([_Detailed()])(gm)
    assert (record.name, record.modified, record.counters, record.details) == (
        "detailed",
        False,
        {"n": 1},
        {"why": ["x"]},
    )
    gm = _export(nn.LayerNorm(4), torch.randn(2, 4))  # nothing read only through casts
    assert not StoreLowPrecisionParams()(gm).modified
    gm, _ = _o2(nn.Linear(4, 4), torch.randn(2, 4))
    assert gm.weight.dtype == torch.float16
    gm2 = _export(nn.Linear(4, 4), torch.randn(2, 4))
    PassManager([AnnotatePrecision(PrecisionPolicy("fp16", Level.O2)), InsertCasts(), CleanupCasts()])(gm2)
    assert StoreLowPrecisionParams()(gm2).modified


def test_retype_of_a_real_tensor_converts_it() -> None:
    from amplite.passes.graph_utils import retype

    out = retype(torch.ones(2), torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out, torch.ones(2, dtype=torch.float16))
    assert retype(3, torch.float16) == 3


class _ScalarAndGains(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.g1, self.g2 = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.rand(4) + 0.5)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.g1 + self.b(x) * self.g2 + self.a(x) * self.s


def test_promotions_are_counted_and_zero_dim_operands_are_not_cast() -> None:
    model, x = _ScalarAndGains().eval(), torch.randn(3, 4)
    gm = _export(model, x)
    gm, records = PassManager([AnnotatePrecision(PrecisionPolicy("fp16", Level.O1)), InsertCasts()])(gm)
    counters = records[-1].counters
    assert counters["promotions_in_kernel"] == 3, counters  # two fp16 * FP32-gain products, one fp32 + fp16 add
    s = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "s")
    assert all(cast_dtype(u) is None for u in s.users), "a 0-dim FP32 operand of a follow op is read as it is"
    torch.testing.assert_close(gm(x), model(x), atol=2e-2, rtol=2e-2)


class _OneElementWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([1e5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def test_a_one_element_weight_beyond_fp16_is_flagged() -> None:
    flags, _ = _guard(_OneElementWeight(), torch.full((2, 3), 1e-6), RangeRules())
    assert flags == {"mul": "range:weight-overflow s |w|=1e+05"}, flags


def test_a_bias_is_viewed_to_the_contraction_modes() -> None:
    # a.reshape(6, 4) merges two source dims: the contraction runs on (2, 3, 4), its bias as (2, 3, 5).
    gm, counters = _fuse(
        _Fn(lambda a, w, b: a.reshape(6, 4) @ w + b), torch.randn(2, 3, 4), torch.randn(4, 5), torch.randn(6, 5)
    )
    assert counters == {"fused:matmul": 1, "absorbed:view": 1, "absorbed:bias": 1}, counters
    contract = next(n for n in gm.graph.nodes if n.target is CONTRACT)
    assert list(contract.args[3].meta["val"].shape) == [2, 3, 5]


def test_shared_intermediate_with_a_scaling_is_a_recorded_rejection() -> None:
    a, b = torch.randn(4, 3), torch.randn(4, 5)
    gm = _export(_Fn(lambda a, b: ((s := a.t() @ b) * 0.5, s)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    assert [r.reason for r in res.rejections] == ["shared_intermediate"], res.rejections


def test_retype_of_tuples_and_same_dtype() -> None:
    from amplite.passes.graph_utils import retype

    t = torch.ones(2)
    assert retype(t, torch.float32) is t, "same dtype: the value itself"
    fake = next(n for n in _export(nn.Linear(2, 2), torch.randn(1, 2)).graph.nodes if n.op == "placeholder").meta["val"]
    assert retype(fake, fake.dtype) is fake and retype(fake, torch.float16).dtype == torch.float16
    pair = retype((t, t), (torch.float16, torch.float32))
    assert isinstance(pair, tuple) and pair[0].dtype == torch.float16 and pair[1] is t
    assert retype([t], (torch.float16,))[0].dtype == torch.float16
    assert retype((t, t), None) == (t, t) and retype((t, t), (torch.float16,)) == (t, t)  # no or mismatched dtypes


def test_layout_only_contiguous_and_tensor_products_around_a_contraction() -> None:
    cl = _Fn(lambda a, b: a.contiguous(memory_format=torch.channels_last) @ b)
    gm, counters = _fuse(cl, torch.randn(2, 3, 4, 5), torch.randn(5, 6))
    assert counters == {"fused:matmul": 1, "absorbed:contiguous": 1}, counters  # a layout change only
    contract = next(n for n in gm.graph.nodes if n.target is CONTRACT)
    assert contract.meta["amplite_contract"] == {"rule": "matmul", "absorbed": ["contiguous"]}
    # A product with a tensor (not a constant) on either side is not a scaling to absorb.
    gated = _Fn(lambda a, b, t: t * (a.t() @ b) + (a.t() @ b) * t)
    _, counters = _fuse(gated, torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5))
    assert counters == {"fused:matmul": 2, "absorbed:transpose": 2, "rejected:tensor_scale": 2}, counters


def test_rejections_say_what_was_not_absorbed_and_a_cast_on_the_source_is_the_source() -> None:
    from dataclasses import asdict

    a, b = torch.randn(4, 3), torch.randn(4, 5)
    gm = _export(_Fn(lambda a, b: ((t := a.t()) @ b, t)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS, fuse_plain=True)(gm)
    assert [asdict(r) for r in res.rejections] == [
        {"node": "t", "rule": "matmul", "reason": "intermediate_is_graph_output", "detail": "not absorbed into matmul"}
    ], res.rejections
    ints = (torch.randint(-3, 4, (4, 3)).float(), torch.randint(-3, 4, (4, 5)).float())  # exact in fp16
    gm, counters = _fuse(_Fn(lambda a, b: a.half().t() @ b.half()), *ints)
    assert counters.get("fused:matmul") == 1, counters


def test_bad_permutation_names_the_order() -> None:
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    with pytest.raises(NotFusable) as info:
        Operand.from_shape(ModeTable(), [2, 3]).permute([1, 1])
    assert (info.value.reason, info.value.detail) == ("bad_permutation", "[1, 1]")


class _UserCastThenFollow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.half()
        return h + h  # a follow op on a user cast computes in the cast's dtype


def test_user_cast_output_dtype_is_the_cast_dtype() -> None:
    gm = _export(_UserCastThenFollow(), torch.randn(2, 3))
    AnnotatePrecision(PrecisionPolicy("bf16", Level.O1))(gm)
    cast = next(n for n in gm.graph.nodes if cast_dtype(n) is not None)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert cast.meta["amplite_out_dtype"] == torch.float16
    assert add.meta["amplite_precision"]["dtype"] == torch.float16, add.meta["amplite_precision"]


@pytest.mark.parametrize("partner_first", [True, False])
def test_cast_after_data_movement_merges_with_the_existing_cast(partner_first: bool) -> None:
    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if partner_first:
            return x.half() * 2, x.t().half() * 3
        t = x.t().half() * 3
        return x.half() * 2, t

    x = torch.randn(3, 4)
    gm = _export(_Fn(both), x)
    result = CleanupCasts()(gm)
    gm.recompile()
    casts = [n for n in gm.graph.nodes if cast_dtype(n) is not None]
    assert len(casts) == 1 and result.counters["moved_above_data_movement"] == 1, (casts, result.counters)
    gm.graph.lint()
    got = gm(x)
    assert torch.equal(got[0], x.half() * 2) and torch.equal(got[1], x.t().half() * 3)


def test_two_movable_casts_in_one_graph_both_move() -> None:
    x, y = torch.randn(3, 4), torch.randn(5, 2)
    gm = _export(_Fn(lambda x, y: (x.half() + 1, x.t().half() * 3, y.half() - 1, y.t().half() * 2)), x, y)
    result = CleanupCasts()(gm)
    gm.recompile()
    assert result.counters["moved_above_data_movement"] == 2, result.counters
    assert len([n for n in gm.graph.nodes if cast_dtype(n) is not None]) == 2
    assert torch.equal(gm(x, y)[3], y.t().half() * 2)


class _IntsAndCompare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.avg.mul_(0.5).add_(x.mean(0))  # in-place ops stay in-place in the unlifted graph
        return ids + 1, self.lin(x) > 0


def test_annotation_covers_float_nodes_only_and_in_place_ops_follow() -> None:
    gm = _export(_IntsAndCompare(), torch.randn(2, 4), torch.arange(3))
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O2))(gm)
    plan = _precision(gm)
    int_add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.args[0].name == "ids")
    assert int_add.name not in plan, "a node without floating inputs or outputs gets no precision plan"
    gt = next(n for n in gm.graph.nodes if "gt" in str(n.target))
    assert plan[gt.name]["dtype"] == torch.float16, "a comparison of float values is planned"
    assert plan["mul_"] == {"mode": "follow", "dtype": torch.float32, "reason": "in-place", "rule": "dtype"}, plan[
        "mul_"
    ]
    assert plan["add_"]["mode"] == "follow" and plan["add_"]["reason"] == "in-place"


def _precision(gm: torch.fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta["amplite_precision"] for n in gm.graph.nodes if "amplite_precision" in n.meta}


def test_rejections_name_their_rule_and_fuse_plain_fuses_bare_contractions() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    gm = _export(_Fn(lambda a, b: torch.einsum("...ij,...jk->...ik", a, b)), a, b)
    res = FuseContractions(dtypes=ALL_FLOATS)(gm)
    assert [(r.rule, r.reason) for r in res.rejections] == [("einsum", "einsum_ellipsis")], res.rejections
    plain = _Fn(lambda a, b: a @ b)
    _, counters = _fuse(plain, torch.randn(3, 4), torch.randn(4, 5), fuse_plain=True)
    assert counters == {"fused:matmul": 1}, counters
    _, counters = _fuse(plain, torch.randn(3, 4), torch.randn(4, 5))
    assert counters == {"skipped:nothing_to_absorb": 1}, counters


def test_unknown_precision_in_policy_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        PrecisionPolicy("fp8")
    assert info.value.one_line() == "unknown precision 'fp8' — fix: use one of: fp16, bf16"


def test_mode_bookkeeping_errors_name_the_problem() -> None:
    from amplite.passes import einsum_equation as eqn
    from amplite.passes.einsum_modes import ModeTable, NotFusable, Operand

    def reason(fn) -> tuple[str, str]:
        with pytest.raises(NotFusable) as info:
            fn()
        return info.value.reason, info.value.detail

    t = ModeTable()
    assert reason(lambda: Operand.from_shape(t, [2, 3])._norm(5)) == ("bad_dim", "5 for rank 2")
    assert reason(lambda: Operand.from_shape(t, [0, 3])) == ("zero_size", "")
    assert reason(lambda: Operand.from_shape(t, [2, 3]).view(t, [3, 2])) == ("irregular_reshape", "[2, 3] -> [3, 2]")
    assert reason(lambda: Operand.from_shape(t, [2, 3]).view(t, [4, 2])) == ("bad_view", "[4, 2] for 6 elements")
    a, b = Operand.from_shape(t, [2, 3, 4]), Operand.from_shape(t, [5, 4, 6])
    assert reason(lambda: eqn.matmul_groups(t, a, b)) == ("bad_broadcast", "2 vs 5")


def test_a_vector_operand_of_matmul_is_not_fused() -> None:
    _, counters = _fuse(_Fn(lambda v, m: v @ m.t()), torch.randn(4), torch.randn(5, 4))
    assert counters == {"rejected:vector_operand": 1}, counters
    _, counters = _fuse(_Fn(lambda m, v: m.t() @ v), torch.randn(4, 5), torch.randn(4))
    assert counters == {"rejected:vector_operand": 1}, counters


def test_cast_dtype_reads_every_cast_form() -> None:
    from amplite.passes.graph_utils import cast_dtype

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)
    call = g.call_function
    assert cast_dtype(call(aten.to.dtype, (x,), {"dtype": torch.float16})) == torch.float16
    assert cast_dtype(call(aten.to.dtype, (x, torch.bfloat16))) == torch.bfloat16
    same_place = {
        "dtype": torch.float16,
        "layout": torch.strided,
        "device": torch.device("cpu"),
        "pin_memory": False,
        "non_blocking": False,
        "copy": True,
    }
    assert cast_dtype(call(aten._to_copy.default, (x,), same_place)) == torch.float16
    moves = call(aten._to_copy.default, (x,), {"dtype": torch.float16, "device": torch.device("meta")})
    assert cast_dtype(moves) is None, "a cast that also moves devices is not a pure cast"
    fmt = call(aten._to_copy.default, (x,), {"dtype": torch.float16, "memory_format": torch.channels_last})
    assert cast_dtype(fmt) is None


@pytest.mark.parametrize(("a", "b"), [((2, 3), (2,)), ((2,), (2, 3))])
def test_unify_rejects_groups_of_different_extents(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    from amplite.passes import einsum_equation as eqn
    from amplite.passes.einsum_modes import ModeTable, NotFusable

    t = ModeTable()
    with pytest.raises(NotFusable) as info:
        eqn.unify(t, [t.new(n) for n in a], [t.new(n) for n in b])
    assert (info.value.reason, info.value.detail) == ("incompatible_factorization", "extents differ")


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
