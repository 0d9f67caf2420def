"""The cuTENSOR backend cannot crash a forward: probe verdicts, per-call fallback, one-rounding numerics.

Every failure is simulated on CPU: a fake ``nvmath`` module stands in for nvmath-python and the probe is
allowed to run on CPU tensors (``DEVICE_TYPES``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import types
from typing import ClassVar

import pytest
import torch

import amplite.ops
from amplite.errors import ConfigError
from amplite.ops import cutensor_backend
from amplite.ops import cutensor_backend as cb
from tests import fake_nvmath

contract_mod = importlib.import_module("amplite.ops.contract")  # the module; amplite.ops.contract is the op

CONTRACT = torch.ops.amplite.contract.default


class Fake:
    """A configurable stand-in for ``nvmath.tensor.BinaryContraction`` (computes in FP32, like cuTENSOR)."""

    fail_init: Exception | None = None
    fail_plan: Exception | None = None
    fail_execute: Exception | None = None
    refuse_dtypes: tuple = ()
    refuse_stride0_c = False
    wrong = False
    created = 0

    def __init__(self, expr, a, b, *, c=None, out=None, stream=None):
        Fake.created += 1
        if Fake.fail_init is not None:
            raise Fake.fail_init
        if a.dtype in Fake.refuse_dtypes:
            raise ValueError(f"Unsupported data type {a.dtype}")
        if c is not None and Fake.refuse_stride0_c and 0 in c.stride():
            raise RuntimeError("CUTENSOR_STATUS_INVALID_VALUE")
        self.expr, self.ops = expr, {"a": a, "b": b, "c": c, "out": out}

    def plan(self, stream=None):
        if Fake.fail_plan is not None:
            raise Fake.fail_plan

    def free(self):
        pass

    def reset_operands(self, a=None, b=None, *, c=None, out=None, stream=None):
        self.ops.update(a=a, b=b, c=c, out=out)

    def execute(self, *, alpha=1.0, beta=None, release_workspace=False, stream=None):
        if Fake.fail_execute is not None:
            raise Fake.fail_execute
        o = self.ops
        res = alpha * torch.einsum(self.expr, o["a"].float(), o["b"].float())
        if o["c"] is not None:
            res = res + beta * o["c"].float()
        o["out"].copy_(res + 1.0 if Fake.wrong else res)
        return o["out"]


@pytest.fixture
def nvmath(monkeypatch):
    """A fake nvmath-python 1.0.0 whose failures each test configures; the probe may run on CPU."""
    for attr in ("fail_init", "fail_plan", "fail_execute"):
        monkeypatch.setattr(Fake, attr, None)
    monkeypatch.setattr(Fake, "refuse_dtypes", ())
    monkeypatch.setattr(Fake, "refuse_stride0_c", False)
    monkeypatch.setattr(Fake, "wrong", False)
    Fake.created = 0
    mod = fake_nvmath.install(monkeypatch, Fake)
    yield mod
    cb.reset_probes()
    cb.clear_cache()


def test_probe_passes_with_working_library(nvmath):
    assert cb.probe("cpu", torch.float16) == cb.Probe(True)
    assert cb.cache_stats()["plans"] == 0  # the probe's own plans are not counted as the user's
    assert cb.cutensor_version() == "2.3.1"


def test_missing_library(monkeypatch):
    monkeypatch.delitem(sys.modules, "nvmath", raising=False)
    monkeypatch.setattr(cb.importlib.util, "find_spec", lambda name: None)
    cb.reset_probes()
    verdict = cb.probe("cuda:0", torch.float16)
    assert not verdict.ok and "not installed" in verdict.reason
    assert contract_mod.active_backend("cuda:0") == "torch"
    assert "not installed" in contract_mod.backend_description("cuda:0")
    cb.reset_probes()


@pytest.mark.parametrize(("version", "ok"), [("0.6.0", False), ("0.7.1", False), ("1.0.0", True), ("2.0.0", False)])
def test_version_gate(nvmath, monkeypatch, version, ok):
    monkeypatch.setattr(cb, "nvmath_version", lambda: version)
    verdict = cb.probe("cpu", torch.float16)
    assert verdict.ok is ok
    if not ok:
        assert version in verdict.reason and "1.x" in verdict.reason


def test_nvmath_without_tensor_module(nvmath):
    del nvmath.tensor  # nvmath-python < 0.7 has no nvmath.tensor
    verdict = cb.probe("cpu", torch.float16)
    assert not verdict.ok and "nvmath.tensor" in verdict.reason and "AttributeError" in verdict.reason


@pytest.mark.parametrize(
    ("where", "exc", "needle"),
    [
        ("fail_init", RuntimeError("cuTensor version 20000 is detected, lower than 2.3.1"), "cuTensor version"),
        ("fail_plan", RuntimeError("CUTENSOR_STATUS_NOT_SUPPORTED"), "NOT_SUPPORTED"),
        ("fail_execute", RuntimeError("CUTENSOR_STATUS_ARCH_MISMATCH"), "ARCH_MISMATCH"),
        ("fail_init", OSError("libcutensor.so.2: cannot open shared object file"), "libcutensor"),
    ],
)
def test_probe_failures_fall_back_with_reason(nvmath, caplog, where, exc, needle):
    setattr(Fake, where, exc)
    with caplog.at_level(logging.WARNING, logger="amplite.contract"):
        for _ in range(3):
            verdict = cb.probe("cpu", torch.bfloat16)
    assert not verdict.ok and needle in verdict.reason
    assert sum(needle in r.getMessage() for r in caplog.records) == 1  # logged once, not per call
    assert Fake.created == 1  # the verdict is cached: probed once


def test_probe_catches_wrong_results(nvmath):
    Fake.wrong = True
    verdict = cb.probe("cpu", torch.float16)
    assert not verdict.ok and "wrong values" in verdict.reason


def test_unsupported_dtype_is_per_dtype(nvmath, monkeypatch):
    Fake.refuse_dtypes = (torch.bfloat16,)
    assert cb.probe("cpu", torch.float16).ok
    bad = cb.probe("cpu", torch.bfloat16)
    assert not bad.ok and "Unsupported data type" in bad.reason
    # The report line names what runs where.
    monkeypatch.setattr(cb, "probe", lambda d, dt: cb._probes[("cpu", dt)])
    line = contract_mod.backend_description("cuda")
    assert line.startswith("cutensor for float16") and "bfloat16: ValueError" in line


def test_forced_cutensor_names_the_reason(nvmath, monkeypatch):
    Fake.fail_init = RuntimeError("cuTensor version 20000 is detected")
    monkeypatch.setattr(cb, "probe", lambda d, dt=torch.float16: cb._run_probe(torch.device("cpu"), dt))
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "cutensor")
    with pytest.raises(RuntimeError, match="cuTensor version 20000"):
        contract_mod.active_backend("cuda:0")


@pytest.mark.parametrize("where", ["fail_plan", "fail_execute"])
def test_per_call_failure_falls_back_and_is_not_retried(nvmath, caplog, where):
    """A plan/execute error on one problem (shape, stride or alignment cuTENSOR refuses) never reaches the user."""
    a, b = torch.randn(4, 6).half(), torch.randn(6, 5).half()
    setattr(Fake, where, RuntimeError("CUTENSOR_STATUS_INVALID_VALUE: misaligned"))
    with caplog.at_level(logging.WARNING, logger="amplite.contract"):
        for _ in range(3):
            assert cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0) is None
    assert Fake.created == 1  # remembered as failed, not planned again
    stats = cb.cache_stats()
    assert stats["errors"] == 1 and stats["fallbacks"] == 2
    assert sum("misaligned" in r.getMessage() for r in caplog.records) == 1


def test_op_survives_backend_failure(nvmath, monkeypatch):
    """Through the op: cuTENSOR chosen, then failing at execute: the result is the einsum backend's."""
    monkeypatch.setattr(contract_mod, "active_backend", lambda device, dtype=None: "cutensor")
    Fake.fail_execute = RuntimeError("CUTENSOR_STATUS_EXECUTION_FAILED")
    a, b = torch.randn(3, 8).half(), torch.randn(8, 2).half()
    out = CONTRACT("mk,kn->mn", a, b, None, 0.5, 0.0)
    torch.testing.assert_close(out.float(), 0.5 * (a.float() @ b.float()), rtol=1e-3, atol=1e-3)
    assert cb.cache_stats()["errors"] == 1


def test_stride0_bias_refused_is_materialised(nvmath):
    Fake.refuse_stride0_c = True
    a, b, c = torch.randn(3, 8).half(), torch.randn(8, 2).half(), torch.randn(2).half()
    for _ in range(2):
        out = cb.contract("mk,kn->mn", a, b, c, 1.0, 1.0)
        torch.testing.assert_close(out.float(), a.float() @ b.float() + c.float(), rtol=2e-3, atol=2e-3)
    assert cb._stride0_c == {"cpu": False}


# --- numerics: FP32 accumulation, alpha and bias in FP32, one rounding -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_einsum_backend_scales_before_rounding(dtype):
    # q·kᵀ = 64 * 64 * 32 = 131072 overflows fp16; alpha = 1/8 brings it to 16384. Rounding the product to
    # fp16 first gives inf (off by orders of magnitude); one rounding gives 16384 exactly.
    q = torch.full((1, 64), 64.0, dtype=dtype)
    k = torch.full((64, 1), 32.0, dtype=dtype)
    out = contract_mod.torch_contract("mk,kn->mn", q, k, None, 0.125, 0.0)
    assert out.item() == 16384.0
    # The bias, too, is scaled and added in FP32 before the one rounding: 131072 - 2 * 61440 = 8192.
    c = torch.full((1,), -61440.0, dtype=dtype)
    assert contract_mod.torch_contract("mk,kn->mn", q, k, c, 1.0, 2.0).item() == 8192.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "cutensor"])
def test_overflow_only_if_rounded_early_on_cuda(monkeypatch, backend):
    if backend == "cutensor" and not cb.probe("cuda", torch.float16).ok:
        pytest.skip(f"cuTENSOR unusable here: {cb.probe('cuda', torch.float16).reason}")
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", backend)
    q = torch.full((2, 4, 8, 64), 64.0, dtype=torch.float16, device="cuda")
    k = torch.full((2, 4, 8, 64), 32.0, dtype=torch.float16, device="cuda")
    out = CONTRACT("bqhd,bkhd->bhqk", q, k, None, 0.125, 0.0)
    assert torch.isfinite(out).all() and out.eq(16384.0).all()
    # The bias is scaled and added in FP32 before the one rounding: 131072 - 2 * 61440 = 8192 (the product
    # alone, 131072, is past fp16's 65504). Broadcast: it goes in as a stride-0 C.
    bias = torch.full((4,), -61440.0, dtype=torch.float16, device="cuda")
    out = CONTRACT("bqhd,bkhd->bhqk", q, k, bias, 1.0, 2.0)
    assert torch.isfinite(out).all() and out.eq(8192.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probe_and_report_line():
    line = contract_mod.backend_description("cuda")
    verdict = cb.probe("cuda", torch.float16)
    assert line.startswith("cutensor") == verdict.ok, line
    if verdict.ok:
        assert "nvmath-python 1." in line


# --- --fuse-contractions auto -------------------------------------------------------------------------------


def test_fuse_auto_is_off_without_a_measurement(monkeypatch):
    from amplite.ops import fusion_default as fd

    assert fd.resolve("auto")[0] is False and "no CUDA" in fd.resolve(None)[1]
    assert fd.resolve("on") == (True, "on (requested)") and fd.resolve(False)[0] is False
    with pytest.raises(ConfigError, match="auto, on, off"):
        fd.resolve("maybe")
    # A GPU with a working cuTENSOR: still off until the measurement table says fusion is faster there.
    from amplite.ops import fusion_measurements as fm

    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(cb, "probe", lambda d, dt=torch.float16: cb.Probe(True))
    on, why = fd.resolve("auto")
    assert not on and why == (
        "auto: off (no measurement for (NVIDIA H200, cutensor, float16) in amplite/ops/fusion_measurements.py)"
    )
    faster = tuple(fm.Measurement("H200", "cutensor", dt, 1.2, "x") for dt in ("float16", "bfloat16"))
    monkeypatch.setattr(fm, "MEASUREMENTS", faster)
    assert fd.resolve("auto")[0] is True
    monkeypatch.setattr(cb, "probe", lambda d, dt=torch.float16: cb.Probe(False, "no lib"))
    assert fd.resolve("auto")[0] is False  # the fallback backend was not measured


def test_convert_records_the_fusion_choice():
    import amplite

    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    auto = amplite.convert(model, (x,), verify=False)
    cfg = auto.report.data["config"]
    assert cfg["fuse_contractions"] is False and cfg["fuse_contractions_reason"].startswith("auto: off")
    on = amplite.convert(model, (x,), verify=False, fuse_contractions="on").report.data["config"]
    assert on["fuse_contractions"] is True and on["contract_backend"]
    with pytest.raises(ConfigError, match="fuse-contractions"):
        amplite.convert(model, (x,), verify=False, fuse_contractions="sometimes")


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
def plan_nvmath(monkeypatch: pytest.MonkeyPatch):
    mod = types.ModuleType("nvmath")
    mod.tensor = types.SimpleNamespace(BinaryContraction=_Plan)
    monkeypatch.setitem(sys.modules, "nvmath", mod)
    monkeypatch.setattr(cutensor_backend, "_alignment", lambda t: 256)
    cutensor_backend.clear_cache()
    _Plan.made = []
    yield
    cutensor_backend.clear_cache()


def test_full_size_bias_goes_in_as_c_and_operands_are_unbound(plan_nvmath: None) -> None:
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


def test_spec_resolves_auto_for_the_conversion_dtype(monkeypatch):
    """The spec asks the table about its own precision: a bf16 conversion is decided by the bf16 entry."""
    from amplite.ops import fusion_measurements as fm
    from amplite.spec import ConvertSpec

    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cb, "probe", lambda d, dt=torch.float16: cb.Probe(True))
    table = (
        fm.Measurement("H100", "cutensor", "bfloat16", 1.25, "bench/RESULTS-gpu.md (run X)"),
        fm.Measurement("H100", "cutensor", "float16", 0.9, "bench/RESULTS-gpu.md (run X)"),
    )
    monkeypatch.setattr(fm, "MEASUREMENTS", table)
    bf16 = ConvertSpec.build(precision="bf16")
    assert bf16.fuse is True and "1.25 (bench/RESULTS-gpu.md (run X))" in bf16.fuse_reason
    fp16 = ConvertSpec.build(precision="fp16")
    assert fp16.fuse is False and "not faster" in fp16.fuse_reason and "0.90" in fp16.fuse_reason
    assert fp16.to_config()["fuse_contractions_reason"] == fp16.fuse_reason
