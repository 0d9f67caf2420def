"""X"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

import amplite.ops  # noqa: F401  (registers the op)
from amplite.errors import ConfigError
from amplite.ops import cutensor_backend as cb
from amplite.ops import fusion_default as fd
from tests import fake_nvmath

contract_mod = importlib.import_module("amplite.ops.contract")  # the module; amplite.ops.contract is the op


LOGGER = "amplite.contract"


PREFIX = "amplite::contract falls back to the torch GEMM: "


class Rec:
    """A recording stand-in for ``nvmath.tensor.BinaryContraction``; class attributes configure failures."""

    calls: ClassVar[list[tuple[str, Any]]] = []
    fail_init: Exception | None = None
    fail_plan: Exception | None = None
    fail_reset: Exception | None = None
    fail_execute: Exception | None = None
    fail_free: Exception | None = None
    refuse_stride0_c = False
    scale = 1.0  # multiply the result (a wrong library)
    offset = 0.0  # add to the result (a wrong library)

    def __init__(self, expr: str, a: torch.Tensor, b: torch.Tensor, *, c=None, out=None, stream=None) -> None:
        Rec.calls.append(("init", (expr, a, b, c, out, stream)))
        if Rec.fail_init is not None:
            raise Rec.fail_init
        if c is not None and Rec.refuse_stride0_c and 0 in c.stride():
            raise RuntimeError("CUTENSOR_STATUS_INVALID_VALUE")
        self.expr, self.ops = expr, {"a": a, "b": b, "c": c, "out": out}
        self.planned = False

    def plan(self, stream=None) -> None:
        Rec.calls.append(("plan", stream))
        if Rec.fail_plan is not None:
            raise Rec.fail_plan
        self.planned = True

    def free(self) -> None:
        Rec.calls.append(("free", self))
        if Rec.fail_free is not None:
            raise Rec.fail_free

    def reset_operands(self, a=None, b=None, *, c=None, out=None, stream=None) -> None:
        Rec.calls.append(("reset", (a, b, c, out, stream)))
        if Rec.fail_reset is not None and a is not None:
            raise Rec.fail_reset
        self.ops.update(a=a, b=b, c=c, out=out)

    def execute(self, *, alpha=1.0, beta=None, release_workspace=False, stream=None) -> torch.Tensor:
        Rec.calls.append(("execute", (alpha, beta, release_workspace, stream)))
        if Rec.fail_execute is not None:
            raise Rec.fail_execute
        assert self.planned
        o = self.ops
        res = alpha * torch.einsum(self.expr, o["a"].float(), o["b"].float())
        if o["c"] is not None:
            res = res + beta * o["c"].float()
        o["out"].copy_(res * Rec.scale + Rec.offset)
        return o["out"]


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    """torch.allclose with the difference in the message (torch.testing.assert_close costs 2 s to warm up)."""
    assert torch.allclose(got, want, rtol=rtol, atol=atol), (got - want).abs().max()


def _calls(kind: str) -> list[Any]:
    return [args for k, args in Rec.calls if k == kind]


@pytest.fixture
def nv(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A fake nvmath-python 1.0.0 (cuTENSOR 2.3.1); the probe may run on CPU; pointer alignment pinned."""
    for attr in ("fail_init", "fail_plan", "fail_reset", "fail_execute", "fail_free"):
        monkeypatch.setattr(Rec, attr, None)
    monkeypatch.setattr(Rec, "refuse_stride0_c", False)
    monkeypatch.setattr(Rec, "scale", 1.0)
    monkeypatch.setattr(Rec, "offset", 0.0)
    monkeypatch.setattr(Rec, "calls", [])
    mod = fake_nvmath.install(monkeypatch, Rec)
    Rec.calls.clear()
    yield mod
    cb.reset_probes()
    cb.clear_cache()


def _ab(m: int = 3, k: int = 4, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 100 + k * 10 + n)
    return torch.randn(m, k, generator=g).half(), torch.randn(k, n, generator=g).half()


# --- small helpers: versions, one-line messages, warn_once --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("1.0.0", (1, 0)), ("1.2.3", (1, 2)), ("12.34.5", (12, 34)), ("1.2.3rc1", (1, 2)), ("1.0a", (1, 0)), ("2", (2,)),
     ("v1.5", (1, 5)), ("?", None), ("1.x", None), ("", None)],
)  # fmt: skip
def test_version_tuple_reads_major_minor_digits(text: str, parsed: tuple[int, ...] | None) -> None:
    """Only major.minor count; non-digits inside a part are dropped; a part without digits is unknown."""
    assert cb._version_tuple(text) == parsed


def test_one_line_is_type_and_first_line_capped_at_200() -> None:
    """Reasons in the log and the report are one line: ``Type: first line`` (200 chars at most), or ``Type``."""
    assert cb._one_line(ValueError("  first line\nsecond line ")) == "ValueError: first line"
    assert cb._one_line(RuntimeError()) == "RuntimeError"
    assert cb._one_line(RuntimeError("   \n  ")) == "RuntimeError"
    assert cb._one_line(KeyError("x" * 300)) == "KeyError: '" + "x" * 199
    assert cb._one_line(OSError("ends with colon:")) == "OSError: ends with colon"
    assert cb._one_line(OSError("MAX")) == "OSError: MAX"  # only colons and spaces are trimmed


def test_warn_once_logs_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    """A reason reaches the log once per process, with the fallback prefix; another reason is logged too."""
    cb.reset_probes()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            cb.warn_once("reason one")
        cb.warn_once("reason two")
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert msgs == [PREFIX + "reason one", PREFIX + "reason two"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == LOGGER)
    cb.reset_probes()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cb.warn_once("reason one")  # reset_probes forgets what was logged
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER][-1] == PREFIX + "reason one"
    cb.reset_probes()


# --- load_nvmath / cutensor_version ---------------------------------------------------------------------------


def test_load_nvmath_returns_the_module_and_checks_the_version(nv: types.ModuleType, monkeypatch) -> None:
    """1.x loads (also an unparsable version); <1.0 and >=2.0 are refused with the installed version named."""
    assert cb.load_nvmath() is nv
    for ok in ("1.0.0", "1.99.0", "?", "dev"):
        monkeypatch.setattr(cb, "nvmath_version", lambda v=ok: v)
        assert cb.load_nvmath() is nv
    for bad in ("0.9.9", "2.0.0", "0.0"):
        monkeypatch.setattr(cb, "nvmath_version", lambda v=bad: v)
        with pytest.raises(cb.Unavailable) as info:
            cb.load_nvmath()
        why = f"nvmath-python {bad} is installed; amplite needs 1.x (pip install 'amplite[cutensor]')"
        assert str(info.value) == why


def test_load_nvmath_missing_library_and_missing_tensor_module(nv: types.ModuleType, monkeypatch) -> None:
    """Not installed: asks for the extra; installed without ``nvmath.tensor``: names the import error."""
    asked: list[str] = []
    monkeypatch.setattr(cb.importlib.util, "find_spec", lambda name: asked.append(name))
    assert cb.load_nvmath() is nv and asked == []  # already imported: no search
    monkeypatch.delitem(sys.modules, "nvmath")
    with pytest.raises(cb.Unavailable) as info:
        cb.load_nvmath()
    assert str(info.value).startswith("nvmath-python ") and "(pip install 'amplite[cutensor]')" in str(info.value)
    assert asked == ["nvmath"]
    monkeypatch.setitem(sys.modules, "nvmath", nv)
    nv.tensor = types.SimpleNamespace()
    try:
        nv.tensor.BinaryContraction  # noqa: B018
    except AttributeError as e:
        expected = f"nvmath.tensor is unusable: AttributeError: {e}"
    with pytest.raises(cb.Unavailable) as info:
        cb.load_nvmath()
    assert str(info.value) == expected and isinstance(info.value.__cause__, AttributeError)


def test_cutensor_version_is_major_minor_patch(nv: types.ModuleType, monkeypatch) -> None:
    """cuTENSOR encodes its version as major*10000 + minor*100 + patch; any failure reads ``?``."""
    assert cb.cutensor_version() == "2.3.1"
    monkeypatch.setattr(nv.bindings.cutensor, "get_version", lambda: "120345")
    assert cb.cutensor_version() == "12.3.45"
    monkeypatch.setattr(nv.bindings.cutensor, "get_version", lambda: 990000)
    assert cb.cutensor_version() == "99.0.0"
    monkeypatch.setattr(nv.bindings.cutensor, "get_version", lambda: 1 / 0)
    assert cb.cutensor_version() == "?"


# --- probe ------------------------------------------------------------------------------------------------------


def test_probe_runs_two_contractions_and_caches_per_device_and_dtype(nv: types.ModuleType) -> None:
    """fp16 is the default dtype; the probe plans a full-size C and a stride-0 broadcast C, alpha 0.5, beta 2."""
    assert cb.probe("cpu") == cb.Probe(True)
    assert set(cb._probes) == {("cpu", torch.float16)}
    inits = _calls("init")
    assert len(inits) == 2 and all(i[0] == "bmk,kn->bmn" for i in inits)
    (_, a, b, c_full, out, stream), (_, _, _, c_bcast, _, _) = inits
    assert a.shape == (2, 3, 8) and b.shape == (8, 4) and out.shape == (2, 3, 4) and stream is None
    assert a.dtype == b.dtype == c_full.dtype == torch.float16
    assert c_full.shape == (2, 3, 4) and c_full.stride() == (12, 4, 1)
    assert c_bcast.shape == (2, 3, 4) and c_bcast.stride() == (0, 0, 1) and bool((c_bcast == 1).all())
    assert c_bcast.dtype == torch.float16  # cuTENSOR needs one dtype for A, B, C and D
    assert _calls("execute") == [(0.5, 2.0, True, None)] * 2
    assert cb.cache_stats() == {"plans": 0, "hits": 0, "fallbacks": 0, "errors": 0, "cached": 2}
    assert cb.probe("cpu", torch.float16).ok and len(_calls("init")) == 2  # cached verdict
    assert cb.probe("cpu", torch.bfloat16).ok and len(_calls("init")) == 4
    assert set(cb._probes) == {("cpu", torch.float16), ("cpu", torch.bfloat16)}


def test_probe_on_cuda_without_index_is_device_zero(monkeypatch) -> None:
    """``cuda`` means the current device (0 without CUDA); the reason names the resolved device."""
    monkeypatch.setattr(cb, "_run_probe", lambda d, dt: cb.Probe(False, f"seen {d}"))
    cb.reset_probes()
    verdict = cb.probe("cuda", torch.bfloat16)
    assert verdict == cb.Probe(False, "seen cuda:0") and set(cb._probes) == {("cuda:0", torch.bfloat16)}
    assert cb.probe("cuda:1", torch.bfloat16).reason == "seen cuda:1"
    cb.reset_probes()


def test_probe_on_a_non_cuda_device_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Without the CPU test hook, a CPU device is refused by name and the warning names dtype and device."""
    cb.reset_probes()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        verdict = cb.probe("cpu", torch.float32)
    assert verdict == cb.Probe(False, "cuTENSOR runs on CUDA devices only")
    assert set(cb._probes) == {("cpu", torch.float32)}
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        PREFIX + "cuTENSOR unusable for torch.float32 on cpu: cuTENSOR runs on CUDA devices only"
    ]
    cb.reset_probes()


def test_probe_success_logs_nothing(nv: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """A working backend is silent."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert cb.probe("cpu").ok
    assert [r for r in caplog.records if r.name == LOGGER] == []


@pytest.mark.parametrize(
    ("scale", "offset", "ok"),
    [(1.0, 0.015, True), (1.0, 0.1, False), (1.5, 0.0, False), (1.01, 0.0, True), (1.0, -0.1, False)],
)
def test_probe_tolerance_is_two_percent_plus_two_hundredths(nv: types.ModuleType, scale, offset, ok) -> None:
    """allclose(rtol=2e-2, atol=2e-2): a 1.5 % offset / 1 % scale is rounding; 0.1 off or 1.5x is wrong."""
    Rec.scale, Rec.offset = scale, offset
    verdict = cb.probe("cpu", torch.float32)
    assert verdict == (cb.Probe(True) if ok else cb.Probe(False, "the probe contraction returned wrong values"))


def test_probe_wrong_only_for_the_broadcast_bias_is_caught(nv: types.ModuleType, monkeypatch) -> None:
    """Both contractions are checked: a library that mishandles only the stride-0 C is unusable."""
    real = Rec.execute

    def execute(self, **kw):
        out = real(self, **kw)
        if 0 in self.ops["c"].stride():
            out.add_(1.0)
        return out

    monkeypatch.setattr(Rec, "execute", execute)
    assert cb.probe("cpu").reason == "the probe contraction returned wrong values"


def test_probe_reports_a_refused_problem_as_wrong_values(nv: types.ModuleType) -> None:
    """A probe problem the cache remembers as refused gives no result: that is reported, not a crash."""
    a = torch.randn(2, 3, 8).half()
    Rec.fail_plan = RuntimeError("CUTENSOR_STATUS_NOT_SUPPORTED")
    with pytest.raises(RuntimeError):
        cb._execute("bmk,kn->bmn", a, torch.randn(8, 4).half(), torch.randn(2, 3, 4).half(), 0.5, 2.0)
    Rec.fail_plan = None
    assert cb.probe("cpu").reason == "the probe contraction returned wrong values"


def test_probe_failure_reason_is_one_line_and_logged_once(nv: types.ModuleType, caplog) -> None:
    """An exception while probing becomes the verdict's one-line reason, logged once with dtype and device."""
    Rec.fail_execute = RuntimeError("CUTENSOR_STATUS_ARCH_MISMATCH\ndetails")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            verdict = cb.probe("cpu", torch.bfloat16)
    assert verdict == cb.Probe(False, "RuntimeError: CUTENSOR_STATUS_ARCH_MISMATCH")
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        PREFIX + "cuTENSOR unusable for torch.bfloat16 on cpu: RuntimeError: CUTENSOR_STATUS_ARCH_MISMATCH"
    ]


def test_probe_does_not_change_the_users_counters(nv: types.ModuleType) -> None:
    """The probe's plans are not the user's: counters from earlier calls are kept as they were."""
    a, b = _ab()
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    assert cb.probe("cpu").ok
    assert cb.cache_stats() == {"plans": 1, "hits": 1, "fallbacks": 0, "errors": 0, "cached": 3}


# --- plan cache ---------------------------------------------------------------------------------------------------


def test_clear_cache_frees_plans_and_zeroes_counters(nv: types.ModuleType) -> None:
    """Every cached plan is freed (a refused problem has none to free); all counters go back to 0."""
    a, b = _ab()
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    Rec.fail_plan = RuntimeError("no")
    assert cb.contract("mk,kn->mn", *_ab(5, 4, 2), None, 1.0, 0.0) is None
    Rec.fail_plan = None
    plan_objects = [p for p in cb._plans.values() if p is not cb._FAILED]
    assert len(plan_objects) == 1 and len(cb._plans) == 2
    Rec.calls.clear()
    cb.clear_cache()
    assert _calls("free") == plan_objects
    assert cb.cache_stats() == {"plans": 0, "hits": 0, "fallbacks": 0, "errors": 0, "cached": 0}


def test_free_swallows_errors(nv: types.ModuleType) -> None:
    """Freeing during shutdown must not raise; the failed-problem marker is not a plan."""
    Rec.fail_free = RuntimeError("driver shutting down")
    plan = object.__new__(Rec)
    cb._free(plan)
    cb._free(cb._FAILED)
    assert _calls("free") == [plan]


def test_plans_are_reused_and_least_recently_used_evicted(nv: types.ModuleType, monkeypatch) -> None:
    """MAX_PLANS plans stay cached; a hit refreshes a plan; the oldest unused one is freed first."""
    monkeypatch.setattr(cb, "MAX_PLANS", 2)
    p1, p2, p3 = _ab(2, 4, 2), _ab(3, 4, 2), _ab(5, 4, 2)
    for a, b in (p1, p2):
        cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    assert cb.cache_stats()["cached"] == 2 and _calls("free") == []
    first, second = list(cb._plans.values())
    cb.contract("mk,kn->mn", *p1, None, 1.0, 0.0)  # hit: p1 becomes the most recent
    cb.contract("mk,kn->mn", *p3, None, 1.0, 0.0)  # evicts p2, the least recently used
    assert _calls("free") == [second] and first in cb._plans.values()
    assert cb.cache_stats() == {"plans": 3, "hits": 1, "fallbacks": 0, "errors": 0, "cached": 2}


def test_a_hit_rebinds_the_operands_then_unbinds_them(nv: types.ModuleType) -> None:
    """Planned once with (a, b, c, out); a hit rebinds the new tensors; after each call all are unbound."""
    a, b = _ab()
    c = torch.randn(3, 2).half()
    out1 = cb.contract("mk,kn->mn", a, b, c, 1.0, 2.0)
    a2 = a * 2
    out2 = cb.contract("mk,kn->mn", a2, b, c, 1.0, 2.0)
    init = _calls("init")
    assert len(init) == 1 and _calls("plan") == [None]
    resets = _calls("reset")
    assert len(resets) == 3 and resets[0] == (None, None, None, None, None) == resets[2]
    ra, rb, rc, rout, rstream = resets[1]
    assert ra is a2 and rb is b and rc is c and rout is out2 and rstream is None
    assert _calls("execute") == [(1.0, 2.0, True, None)] * 2
    _assert_close(out2.float(), 2 * out1.float() - 2 * c.float(), rtol=1e-2, atol=1e-2)


def test_failed_rebind_marks_the_problem_refused(nv: types.ModuleType, caplog) -> None:
    """A rebind error is counted, logged once with the problem and never retried."""
    a, b = _ab(4, 6, 5)
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    Rec.fail_reset = RuntimeError("misaligned")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0) is None
        Rec.fail_reset = None
        assert cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0) is None
    assert list(cb._plans.values()) == [cb._FAILED]
    assert cb.cache_stats() == {"plans": 1, "hits": 1, "fallbacks": 1, "errors": 1, "cached": 1}
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        PREFIX + "cuTENSOR failed on 'mk,kn->mn' (torch.float16, shapes (4, 6), (6, 5)): RuntimeError: misaligned"
    ]


def test_failed_execute_frees_the_plan_and_marks_it_refused(nv: types.ModuleType) -> None:
    """After an execute error the plan is freed, the problem is remembered as refused, not planned again."""
    a, b = _ab()
    Rec.fail_execute = RuntimeError("boom")
    assert cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0) is None
    (plan,) = _calls("free")
    assert isinstance(plan, Rec) and list(cb._plans.values()) == [cb._FAILED]
    assert _calls("reset")[-1] == (None, None, None, None, None)  # unbound even after the failure
    Rec.fail_execute = None
    assert cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0) is None and len(_calls("init")) == 1
    assert cb.cache_stats() == {"plans": 1, "hits": 0, "fallbacks": 1, "errors": 1, "cached": 1}


def test_failed_planning_frees_the_new_plan(nv: types.ModuleType) -> None:
    """A plan() error frees the half-made plan, and the problem is refused from then on."""
    Rec.fail_plan = RuntimeError("CUTENSOR_STATUS_NOT_SUPPORTED")
    assert cb.contract("mk,kn->mn", *_ab(), None, 1.0, 0.0) is None
    assert len(_calls("free")) == 1 and _calls("execute") == []
    assert list(cb._plans.values()) == [cb._FAILED]
    assert cb.cache_stats() == {"plans": 0, "hits": 0, "fallbacks": 0, "errors": 1, "cached": 1}


def test_unbind_errors_are_ignored(nv: types.ModuleType, monkeypatch) -> None:
    """An error while unbinding operands after a successful call does not lose the result."""
    real = Rec.reset_operands

    def reset(self, a=None, b=None, *, c=None, out=None, stream=None):
        real(self, a, b, c=c, out=out, stream=stream)
        if a is None:
            raise RuntimeError("cannot unbind")

    monkeypatch.setattr(Rec, "reset_operands", reset)
    a, b = _ab()
    out = cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    _assert_close(out.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-2)
    assert cb.cache_stats()["errors"] == 0


# --- _execute: output, C handling, fallbacks --------------------------------------------------------------------


def test_output_is_allocated_from_the_canonical_problem(nv: types.ModuleType) -> None:
    """out has the output modes' sizes, the operands' dtype and device; a lone unit mode is squeezed first."""
    a, b = torch.randn(3, 1, 4).half(), torch.randn(4, 5).half()
    out = cb.contract("mxk,kn->nm", a, b, None, 2.0, 0.0)
    ((expr, ca, cbb, cc, cout, _),) = _calls("init")
    assert expr == "mk,kn->nm" and ca.shape == (3, 4) and cbb is b and cc is None
    assert cout is out and out.shape == (5, 3) and out.dtype == torch.float16 and out.device.type == "cpu"
    assert _calls("execute") == [(2.0, None, True, None)]
    _assert_close(out.float(), 2 * (a[:, 0].float() @ b.float()).t(), rtol=1e-2, atol=1e-2)


def test_beta_zero_drops_c_and_a_full_c_is_passed_as_is(nv: types.ModuleType) -> None:
    """beta == 0 means no C (and beta None to cuTENSOR); a C of the output's shape goes in unchanged."""
    a, b = _ab()
    c = torch.randn(3, 2).half()
    cb.contract("mk,kn->mn", a, b, c, 1.0, 0.0)
    cb.contract("mk,kn->mn", a, b, c, 1.0, 0.5)
    (_, _, _, c0, _, _), (_, _, _, c1, _, _) = _calls("init")
    assert c0 is None and c1 is c
    assert _calls("execute") == [(1.0, None, True, None), (1.0, 0.5, True, None)]


def test_broadcast_c_goes_in_as_a_stride0_view(nv: types.ModuleType) -> None:
    """A broadcast bias is expanded (stride 0, no copy) where cuTENSOR takes stride 0."""
    a, b = _ab()
    c = torch.randn(2).half()
    out = cb.contract("mk,kn->mn", a, b, c, 1.0, 1.0)
    ((_, _, _, cc, _, _),) = _calls("init")
    assert cc.shape == (3, 2) and cc.stride() == (0, 1) and cc.data_ptr() == c.data_ptr()
    _assert_close(out.float(), a.float() @ b.float() + c.float(), rtol=1e-2, atol=1e-2)
    assert cb._stride0_c == {}


def test_refused_stride0_c_is_retried_full_size_and_remembered(nv: types.ModuleType) -> None:
    """cuTENSOR refusing a stride-0 C: retried with a full-size copy, and later calls copy at once."""
    Rec.refuse_stride0_c = True
    a, b = _ab()
    c = torch.randn(2).half()
    out = cb.contract("mk,kn->mn", a, b, c, 1.0, 1.0)
    _assert_close(out.float(), a.float() @ b.float() + c.float(), rtol=1e-2, atol=1e-2)
    assert cb._stride0_c == {"cpu": False}
    first = _calls("init")
    assert [i[3].stride() for i in first] == [(0, 1), (2, 1)]
    assert cb.cache_stats() == {"plans": 1, "hits": 0, "fallbacks": 0, "errors": 0, "cached": 2}
    Rec.calls.clear()
    cb.contract("mk,kn->mn", *_ab(5, 4, 2), c, 1.0, 1.0)
    assert [i[3].stride() for i in _calls("init")] == [(2, 1)]  # straight to the copy


def test_a_full_size_c_that_fails_is_not_retried(nv: types.ModuleType) -> None:
    """Only a stride-0 C is retried as a copy; any other failure falls back at once."""
    Rec.fail_init = RuntimeError("CUTENSOR_STATUS_INVALID_VALUE")
    a, b = _ab()
    assert cb.contract("mk,kn->mn", a, b, torch.randn(3, 2).half(), 1.0, 1.0) is None
    assert cb.contract("mk,kn->mn", *_ab(5, 4, 2), None, 1.0, 0.0) is None
    assert len(_calls("init")) == 2 and cb._stride0_c == {}
    # a non-contiguous C without stride 0 (a transposed full-size bias) is not retried either
    assert cb.contract("mk,kn->mn", *_ab(2, 4, 3), torch.randn(3, 2).half().t(), 1.0, 1.0) is None
    assert len(_calls("init")) == 3 and cb._stride0_c == {}


def test_a_problem_cutensor_cannot_express_is_a_silent_fallback(nv: types.ModuleType, caplog) -> None:
    """A lone summed mode of extent > 1: None, counted as a fallback, no error and no log line."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cb.contract("mxk,kn->mn", torch.randn(3, 2, 4).half(), torch.randn(4, 5).half(), None, 1.0, 0.0) is None
    assert cb.cache_stats() == {"plans": 0, "hits": 0, "fallbacks": 1, "errors": 0, "cached": 0}
    assert caplog.records == [] and Rec.calls == []


@pytest.mark.parametrize(
    ("eq", "sa", "sb", "expect"),
    [
        ("mk,kn->mn", (3, 4), (4, 2), "mk,kn->mn"),
        ("mxk,kn->mn", (3, 1, 4), (4, 2), "mk,kn->mn"),  # lone unit mode squeezed
        ("mk,knx->mn", (3, 4), (4, 2, 1), "mk,kn->mn"),  # ... in b as well
        ("mxk,kn->mn", (3, 2, 4), (4, 2), None),  # lone mode of extent 2
        ("mk,kn->mn", (3, 0), (0, 2), None),  # empty mode
        ("mxk,kxn->mn", (3, 1, 4), (4, 1, 2), "mxk,kxn->mn"),  # shared unit mode kept
        ("mk,kn->mnx", (3, 4), (4, 2), "mk,kn->mnx"),
    ],
)
def test_canonicalize(eq: str, sa: tuple, sb: tuple, expect: str | None) -> None:
    """Lone size-1 modes are squeezed out; lone larger modes and empty modes cannot go to cuTENSOR."""
    a, b = torch.zeros(sa), torch.zeros(sb)
    res = cb.canonicalize(eq, a, b)
    if expect is None:
        assert res is None
    else:
        new_eq, va, vb = res
        assert new_eq == expect
        assert va.dim() == len(new_eq.split(",")[0]) and vb.dim() == len(new_eq.split(",")[1].split("->")[0])
        assert (va is a) == (va.shape == a.shape) and (vb is b) == (vb.shape == b.shape)


def test_canonicalize_refuses_broadcast_operands_but_not_stride0_unit_modes() -> None:
    """An expanded (stride-0) mode of extent > 1 is refused; stride 0 on a size-1 mode is harmless."""
    a = torch.zeros(1, 4).expand(3, 4)
    assert cb.canonicalize("mk,kn->mn", a, torch.zeros(4, 2)) is None
    u = torch.zeros(3, 4).unsqueeze(1)  # (3, 1, 4)
    u0 = u.as_strided((3, 1, 4), (4, 0, 1))
    assert cb.canonicalize("mxk,kxn->mn", u0, torch.zeros(4, 1, 2))[0] == "mxk,kxn->mn"


def test_plan_key_separates_what_rebinding_requires(nv: types.ModuleType, monkeypatch) -> None:
    """Shape, stride, dtype, alignment and C's presence each give a new plan; the same problem reuses one."""
    align = {"v": 256}
    monkeypatch.setattr(cb, "_alignment", lambda t: align["v"])
    a, b = _ab(4, 4, 4)
    calls = [
        (a, b, None, 0.0),
        (a, b, None, 0.0),  # hit
        (a.t(), b, None, 0.0),  # strides
        (a.float(), b.float(), None, 0.0),  # dtype
        (a, b, torch.randn(4, 4).half(), 1.0),  # C present
        (a, b.t(), None, 0.0),
    ]
    for x, y, c, beta in calls:
        cb.contract("mk,kn->mn", x, y, c, 1.0, beta)
    assert cb.cache_stats()["plans"] == 5 and cb.cache_stats()["hits"] == 1
    align["v"] = 128
    cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    assert cb.cache_stats()["plans"] == 6
    key = cb._key("mk,kn->mn", {"a": a, "c": None})
    assert key == ("mk,kn->mn", ("a", (4, 4), (4, 1), torch.float16, torch.device("cpu"), 128), ("c", None))


# --- contract.py: backend choice and report line -------------------------------------------------------------


def test_backend_description_lines(monkeypatch) -> None:
    """The report's contract_backend line for CPU, forced torch, all good, partial and total failure."""
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    assert contract_mod.backend_description("cpu") == f"torch: {contract_mod.FALLBACK} (CPU)"
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", " Torch ")
    assert contract_mod.backend_description("cuda") == (
        f"torch: {contract_mod.FALLBACK} (CUDA; AMPLITE_CONTRACT_BACKEND=torch)"
    )
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND")
    monkeypatch.setattr(cb, "nvmath_version", lambda: "1.0.0")
    monkeypatch.setattr(cb, "cutensor_version", lambda: "2.3.1")
    asked: list[tuple[Any, torch.dtype]] = []
    verdicts = {torch.float16: cb.Probe(True), torch.bfloat16: cb.Probe(True)}
    monkeypatch.setattr(cb, "probe", lambda d, dt: asked.append((d, dt)) or verdicts[dt])
    assert contract_mod.backend_description("cuda:0") == "cutensor (nvmath-python 1.0.0, cuTENSOR 2.3.1)"
    assert asked == [(torch.device("cuda:0"), torch.float16), (torch.device("cuda:0"), torch.bfloat16)]
    verdicts[torch.bfloat16] = cb.Probe(False, "no bf16")
    assert contract_mod.backend_description("cuda") == (
        "cutensor for float16 (nvmath-python 1.0.0, cuTENSOR 2.3.1); "
        f"torch fallback ({contract_mod.FALLBACK}) for bfloat16: no bf16"
    )
    verdicts[torch.float16] = cb.Probe(False, "no fp16")
    assert contract_mod.backend_description("cuda") == (
        f"torch: {contract_mod.FALLBACK} (CUDA; cuTENSOR unusable: float16: no fp16; bfloat16: no bf16)"
    )


def test_active_backend_choices(monkeypatch) -> None:
    """Env names are trimmed and case-free; an unknown one is named; forced cutensor fails with the reason."""
    asked: list[tuple[Any, torch.dtype]] = []
    verdict = {"v": cb.Probe(True)}
    monkeypatch.setattr(cb, "probe", lambda d, dt: asked.append((d, dt)) or verdict["v"])
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "  CUTENSOR ")
    assert contract_mod.active_backend("cuda") == "cutensor"
    assert asked == [(torch.device("cuda"), torch.float16)]
    assert contract_mod.active_backend("cuda", torch.bfloat16) == "cutensor" and asked[-1][1] == torch.bfloat16
    verdict["v"] = cb.Probe(False, "no lib")
    with pytest.raises(RuntimeError) as info:
        contract_mod.active_backend("cuda")
    # the variable that forced it, and the probe's reason
    assert "AMPLITE_CONTRACT_BACKEND=cutensor" in str(info.value) and str(info.value).endswith(": no lib")
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", " TORCH")
    n = len(asked)
    assert contract_mod.active_backend("cuda") == "torch" and len(asked) == n  # no probe when forced off
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "Cublas")
    with pytest.raises(ValueError) as info:
        contract_mod.active_backend("cuda")
    assert "AMPLITE_CONTRACT_BACKEND='cublas'" in str(info.value)  # the value as read (trimmed, lower case)
    assert "'cutensor'" in str(info.value) and "'torch'" in str(info.value)
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "")
    assert contract_mod.active_backend("cuda") == "torch"  # probe still says no: torch, no error


def test_the_op_uses_cutensor_when_chosen_and_einsum_when_it_declines(nv: types.ModuleType, monkeypatch) -> None:
    """The op asks the backend for the operands' device and dtype; a None answer means torch.einsum."""
    seen: list[tuple[Any, torch.dtype]] = []
    monkeypatch.setattr(contract_mod, "active_backend", lambda d, dt: seen.append((d, dt)) or "cutensor")
    a, b = _ab()
    out = torch.ops.amplite.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    assert seen == [(a.device, torch.float16)] and len(_calls("execute")) == 1
    Rec.offset = 0.5  # the fake's result is recognisably its own
    out = torch.ops.amplite.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    _assert_close(out.float(), a.float() @ b.float() + 0.5, rtol=1e-2, atol=1e-2)


# --- fusion_default.resolve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "expect"),
    [(True, (True, "on (requested)")), (False, (False, "off (requested)")), ("on", (True, "on (requested)")),
     (" OFF ", (False, "off (requested)")), ("On", (True, "on (requested)"))],
)  # fmt: skip
def test_resolve_forced_choices(choice: bool | str, expect: tuple[bool, str]) -> None:
    """on/off (any case, trimmed) and booleans force the choice; the reason says it was requested."""
    assert fd.resolve(choice) == expect


def test_resolve_unknown_choice_names_the_choices() -> None:
    """The error names the bad value, the choices and the fix."""
    with pytest.raises(ConfigError) as info:
        fd.resolve("maybe")
    assert "'maybe'" in info.value.problem and "fuse-contractions" in info.value.problem
    assert info.value.fix.startswith("use --fuse-contractions ")
    assert all(choice in info.value.fix for choice in ("auto", "on", "off"))


def test_resolve_auto_without_cuda(monkeypatch) -> None:
    """auto (also None, ' Auto ') is off without CUDA, saying so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = "auto: off (no CUDA device; fusion is measured on GPUs only)"
    assert fd.resolve(None) == fd.resolve(" Auto ") == fd.resolve("auto") == (False, why)


def _gpu(monkeypatch, name: str, verdicts: dict) -> None:
    monkeypatch.delenv("AMPLITE_CONTRACT_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(cb, "probe", lambda d, dt=torch.float16: verdicts[dt])


def test_resolve_auto_decides_per_device_backend_and_dtype(monkeypatch) -> None:
    """The entry for (GPU, the backend that would run, dtype) decides, and the reason names it."""
    from amplite.ops import fusion_measurements as fm

    verdicts = {torch.float16: cb.Probe(True), torch.bfloat16: cb.Probe(False, "no bf16")}
    _gpu(monkeypatch, "NVIDIA H200 NVL", verdicts)
    table = (
        fm.Measurement("H200", "cutensor", "float16", 1.31, "RESULTS-gpu.md run A"),
        fm.Measurement("H200", "torch", "bfloat16", 0.97, "RESULTS-gpu.md run B"),
        fm.Measurement("A100", "cutensor", "bfloat16", 1.5, "a100.md"),
    )
    monkeypatch.setattr(fm, "MEASUREMENTS", table)
    assert fd.resolve("auto", torch.float16) == (
        True, "auto: on (fusion measured faster for (NVIDIA H200 NVL, cutensor, float16): "
        "unfused/fused 1.31 (RESULTS-gpu.md run A))",
    )  # fmt: skip
    # bf16 has no cuTENSOR here: the fallback's own measurement (slower) decides.
    assert fd.resolve("auto", torch.bfloat16) == (
        False, "auto: off (fusion measured not faster for (NVIDIA H200 NVL, torch, bfloat16): "
        "unfused/fused 0.97 (RESULTS-gpu.md run B))",
    )  # fmt: skip
    # dtype unknown (batch): both must be measured faster, the first refusal is named.
    assert fd.resolve("auto")[0] is False and "torch, bfloat16" in fd.resolve("auto")[1]
    verdicts[torch.bfloat16] = cb.Probe(True)  # now cuTENSOR for bf16 too: no entry for that triple
    assert fd.resolve("auto", torch.bfloat16) == (
        False,
        "auto: off (no measurement for (NVIDIA H200 NVL, cutensor, bfloat16) in amplite/ops/fusion_measurements.py)",
    )  # fmt: skip


def test_resolve_auto_with_the_empty_table_is_off_saying_why(monkeypatch) -> None:
    """The shipped table is empty (no GPU run measured fusion yet): auto is off with the reason."""
    from amplite.ops import fusion_measurements as fm

    assert fm.MEASUREMENTS == ()
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", {torch.float16: cb.Probe(True), torch.bfloat16: cb.Probe(True)})
    assert fd.resolve("auto", torch.float16) == (
        False,
        "auto: off (no measurement for (NVIDIA H100 80GB HBM3, cutensor, float16) "
        "in amplite/ops/fusion_measurements.py)",
    )  # fmt: skip


def test_resolve_auto_longest_device_match_wins(monkeypatch) -> None:
    from amplite.ops import fusion_measurements as fm

    _gpu(monkeypatch, "NVIDIA H100 PCIe", {torch.float16: cb.Probe(False, "x"), torch.bfloat16: cb.Probe(False, "x")})
    monkeypatch.setattr(fm, "MEASUREMENTS", (
        fm.Measurement("H100", "torch", "float16", 1.2, "sxm"),
        fm.Measurement("H100 PCIe", "torch", "float16", 0.9, "pcie"),
    ))  # fmt: skip
    assert fd.resolve("auto", torch.float16)[0] is False and "(pcie)" in fd.resolve("auto", torch.float16)[1]


def test_resolve_auto_forced_unusable_cutensor_is_off(monkeypatch) -> None:
    """AMPLITE_CONTRACT_BACKEND=cutensor with cuTENSOR unusable: off with the reason, no crash."""
    bad = cb.Probe(False, "no lib")
    _gpu(monkeypatch, "NVIDIA H200", {torch.float16: bad, torch.bfloat16: bad})
    monkeypatch.setenv("AMPLITE_CONTRACT_BACKEND", "cutensor")
    on, why = fd.resolve("auto", torch.float16)
    assert not on and why.startswith("auto: off (no usable contraction backend (") and "no lib" in why


# --- counters, plan keys, devices, gradients and shape errors ------------------------------------------------


def test_probe_leaves_the_global_rng_alone(nv: types.ModuleType) -> None:
    """The probe draws its inputs from its own seeded generator: the user's torch RNG stream is unchanged."""
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    assert cb.probe("cpu").ok
    assert torch.equal(torch.rand(4), expected)


def test_counters_accumulate(nv: types.ModuleType) -> None:
    """fallbacks and errors count every occurrence, not just whether one happened."""
    lone = torch.randn(3, 2, 4).half(), torch.randn(4, 5).half()
    for _ in range(2):
        assert cb.contract("mxk,kn->mn", *lone, None, 1.0, 0.0) is None
    Rec.fail_plan = RuntimeError("no")
    assert cb.contract("mk,kn->mn", *_ab(2, 4, 2), None, 1.0, 0.0) is None
    assert cb.contract("mk,kn->mn", *_ab(3, 4, 2), None, 1.0, 0.0) is None
    assert cb.cache_stats() == {"plans": 0, "hits": 0, "fallbacks": 2, "errors": 2, "cached": 2}


def test_same_operands_different_equation_get_their_own_plan(nv: types.ModuleType) -> None:
    """Two equations on operands of equal shape, stride and dtype are different problems (key holds the equation)."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 3, generator=g).half(), torch.randn(3, 3, generator=g).half()
    out1 = cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    out2 = cb.contract("km,kn->mn", a, b, None, 1.0, 0.0)
    _assert_close(out1.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-2)
    _assert_close(out2.float(), a.float().t() @ b.float(), rtol=1e-2, atol=1e-2)
    assert cb.cache_stats()["plans"] == 2


def test_output_is_allocated_on_the_operands_device(nv: types.ModuleType) -> None:
    """out lives where a lives (meta tensors here, standing in for a non-default device)."""
    a, b = torch.empty(3, 4, device="meta").half(), torch.empty(4, 2, device="meta").half()
    out = cb.contract("mk,kn->mn", a, b, None, 1.0, 0.0)
    assert out is not None and out.device.type == "meta" and out.shape == (3, 2)


def test_rank_mismatch_is_an_error_fallback_not_a_result(nv: types.ModuleType) -> None:
    """An operand whose rank does not match its subscripts is refused (counted error, None), never truncated."""
    assert cb.contract("mk,kn->mn", torch.randn(3).half(), torch.randn(4, 2).half(), None, 1.0, 0.0) is None
    assert cb.cache_stats()["errors"] == 1 and Rec.calls == []


def test_canonicalize_refuses_an_expanded_mode_of_extent_two() -> None:
    """Stride 0 on a mode of extent 2 is a broadcast cuTENSOR cannot take (the limit is extent > 1)."""
    a = torch.zeros(1, 4).expand(2, 4)
    assert cb.canonicalize("mk,kn->mn", a, torch.zeros(4, 2)) is None


def test_gradient_flows_to_a_alone_when_only_a_requires_it() -> None:
    """d/da sum(a @ b) = b summed over n, broadcast over m; b (no grad wanted) gets none."""
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64)
    torch.ops.amplite.contract("mk,kn->mn", a, b, None, 2.0, 0.0).sum().backward()
    assert a.grad is not None and b.grad is None
    assert torch.allclose(a.grad, 2.0 * b.sum(1).expand(3, 4))


@pytest.mark.parametrize(
    ("eq", "sa", "sb", "sc"),
    [("mk,kn->mn", (1, 3), (3, 7), (1,)), ("mk,kn->mn", (3, 4), (4, 2), (1,)),
     ("bmk,kn->bmn", (1, 3, 5), (5, 4), (3, 1))],
)  # fmt: skip
def test_bias_gradient_sums_broadcast_dims_in_fp32_and_rounds_once(eq: str, sa, sb, sc) -> None:
    """dc = beta * grad summed over every broadcast dim, in FP32, one rounding: beta 0.1 over 7 ones is fp16(0.7)."""
    a, b = torch.randn(sa).half(), torch.randn(sb).half()
    c = torch.zeros(sc, dtype=torch.float16, requires_grad=True)
    out = torch.ops.amplite.contract(eq, a, b, c, 1.0, 0.1)
    out.backward(torch.ones_like(out))
    count = out.numel() // c.numel()
    assert c.grad.shape == c.shape and c.grad.dtype == torch.float16
    assert torch.equal(c.grad, torch.full(sc, 0.1 * count).half()), (c.grad, 0.1 * count)


def test_shape_and_dtype_errors_name_the_problem() -> None:
    """The op's validation errors say what is wrong, with the ranks, sizes or dtypes involved."""
    with pytest.raises(ValueError) as info:
        contract_mod.output_shape("mk,kn->mn", (3, 4), (4, 2, 1))
    assert "'mk,kn->mn'" in str(info.value) and "ranks 2 and 3" in str(info.value)
    with pytest.raises(ValueError) as info:
        contract_mod.output_shape("mk,kn->mn", (3, 4, 1), (4, 2))
    assert "'mk,kn->mn'" in str(info.value) and "ranks 3 and 2" in str(info.value)
    with pytest.raises(ValueError) as info:
        contract_mod.output_shape("mk,kn->mn", (3, 4), (5, 2))
    assert "mode 'k'" in str(info.value) and "sizes 4 and 5" in str(info.value) and "'mk,kn->mn'" in str(info.value)
    h, f = torch.zeros(2, 2).half(), torch.zeros(2, 2)
    with pytest.raises(TypeError) as info:
        torch.ops.amplite.contract("mk,kn->mn", h, h, f, 1.0, 0.0)
    assert "one dtype" in str(info.value) and "(torch.float16, torch.float16, torch.float32)" in str(info.value)
    with pytest.raises(TypeError) as info:
        torch.ops.amplite.contract("mk,kn->mn", h, f, None, 1.0, 0.0)
    assert "one dtype" in str(info.value) and "(torch.float16, torch.float32, None)" in str(info.value)
    i = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(TypeError) as info:
        torch.ops.amplite.contract("mk,kn->mn", i, i, None, 1.0, 0.0)
    assert "floating" in str(info.value) and "torch.int32" in str(info.value)


def test_a_bias_that_does_not_broadcast_is_named() -> None:
    """c must broadcast to the output; the error names both shapes."""
    h = torch.zeros(2, 3).half()
    with pytest.raises(ValueError) as info:
        torch.ops.amplite.contract("mk,kn->mn", h, torch.zeros(3, 4).half(), torch.zeros(3).half(), 1.0, 0.0)
    assert "c of shape (3,)" in str(info.value) and "broadcast to (2, 4)" in str(info.value)
