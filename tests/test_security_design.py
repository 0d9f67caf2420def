"""Issue 27, cases 1-4 and 9: nothing of a .pt2 is evaluated, only operators a traced model contains run.

Each hostile file is built from a real ``torch.export.save`` file. Where torch's own loader falls for it, the
test shows that first (the marker appears, the victim file is overwritten), then that amplite refuses the file:
exit 2, one line, no traceback, nothing written, no marker, in bounded time and memory (a child process under
``RLIMIT_AS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch

import amplite
from amplite.errors import LoadError
from amplite.reading.op_allowlist import refusal
from amplite.reading.pt2 import load_program
from amplite.reading.sym_expr import SymExprError, parse_sym_expr
from tests import fresh
from tests.test_security import P, Small, W, json_edit, rebuild

pytestmark = pytest.mark.filterwarnings("ignore:Duplicate name")
ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3 << 30  # address space of the CLI child: a GB-sized allocation fails instead of swapping the machine


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("design") / "small.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(Small().eval(), (torch.randn(2, 4),)), str(path))
    return path


def run_cli(*args: object, cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``amplite ARGS`` in a fresh process under a memory limit; returns the result and its wall time."""

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    res = fresh.run([sys.executable, "-m", "amplite", *map(str, args)], env=env, cwd=cwd, timeout=timeout,
                    rlimits={resource.RLIMIT_AS: LIMIT})  # fmt: skip
    return res, time.monotonic() - start


def run_cli_many(calls: dict[str, list[object]], cwd: Path, timeout: float = 240) -> dict[str, dict[str, Any]]:
    """Several ``amplite`` calls in ONE fresh process under the memory limit (one start-up instead of one each).

    Each call's exit code, stdout, stderr and seconds come back by key; the interpreter's own stderr (what the
    imports printed before any call) is returned under ``"@startup"`` and must be empty.
    """
    from tests.test_security_io import _DRIVER

    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # as run_cli's
    argv = json.dumps([[str(a) for a in call] for call in calls.values()])
    proc = fresh.run([sys.executable, "-c", _DRIVER, argv], env=env, cwd=cwd, timeout=timeout,
                     rlimits={resource.RLIMIT_AS: LIMIT})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("@@RESULTS@@", 1)[1])
    return {**dict(zip(calls, results, strict=True)), "@startup": {"err": proc.stderr}}


def assert_refused_call(got: dict[str, dict[str, Any]], key: str, needle: str) -> None:
    """:func:`assert_refused` for call ``key`` of :func:`run_cli_many`, within 60 s."""
    assert got["@startup"]["err"] == "", got["@startup"]["err"]  # nothing printed at start-up either
    res = got[key]
    assert res["rc"] == 2, (res["rc"], res["err"][-2000:])
    assert res["err"].count("\n") == 1 and needle in res["err"], res["err"]
    assert res["err"].startswith("error:"), res["err"]  # nothing (no warning) printed before the error
    assert "Traceback" not in res["out"] + res["err"]
    assert res["seconds"] < 60, res


def assert_refused(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert res.stderr.startswith("error:"), res.stderr  # nothing (no warning) printed before the error
    assert "Traceback" not in res.stdout + res.stderr


def first_size(expr: str):
    def edit(doc: dict) -> None:
        values = doc["graph_module"]["graph"]["tensor_values"]
        values["x"]["sizes"][0] = {"as_expr": {"expr_str": expr, "hint": {"as_int": 2}}}

    return edit


# Case 1 and 4: size expressions are parsed by amplite's grammar, never by sympify.
EXEC = "(exec)((chr)(111)+(chr)(112))"
ESCAPES = {
    "parenthesised callee": f"Symbol('s77', integer=True)+0*Integer((len)((({EXEC}),)))",
    "dunder import": "__import__('os').system('true')",
    "attribute": "Symbol('s0').__class__",
    "lambda": "(lambda: 1)()",
    "subscript": "Tuple(Integer(1))[0]",
    "string concatenation": "Symbol('s' + 'x')",
    "keyword call": "Integer(1, evaluate=exec)",
    "huge power": "Integer(9)**Integer(99999999)",
    "huge Pow": "Pow(Integer(9), Integer(99999999))",
    "nested power": "Pow(Pow(Integer(9), Integer(64)), Integer(64))",
    "huge shift": "LShift(Integer(1), Integer(1000000000000000000))",
    "symbolic exponent": "Pow(Integer(2), Symbol('s0', integer=True))",
    "long integer": "Integer(" + "9" * 400 + ")",
    "deep nesting": "Add(" * 300 + "Integer(1)" + ")" * 300,
    "unknown function": "factorial(Integer(100000))",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_grammar_refuses_what_torch_does_not_write(name: str) -> None:
    start = time.monotonic()
    with pytest.raises(SymExprError):
        parse_sym_expr(ESCAPES[name])
    assert time.monotonic() - start < 1.0


def test_grammar_builds_what_torch_writes() -> None:
    """The srepr torch's serializer writes round-trips to the same sympy object."""
    s0, s1 = sympy.Symbol("s0", positive=True, integer=True), sympy.Symbol("s1", positive=True, integer=True)
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    for expr in (2 * s0 * s1, s0 + 1, FloorDiv(s0, 2), ModularIndexing(s0, 1, 4), sympy.Max(s0, s1), s0**2):
        assert parse_sym_expr(sympy.srepr(expr)) == expr
    assert parse_sym_expr("s0*2 + 1") == 2 * sympy.Symbol("s0", integer=True) + 1  # infix, as older files


HOSTILE_SIZES = ["parenthesised callee", "huge power"]
WEIGHT_EDITS = {  # id: (edit of the weights' config, what the refusal says)
    "stride0": (lambda doc: _stride0(doc), "is stored as torch.float32 [100000, 100000]"),
    "shape": (lambda doc: _transposed(doc), "[4, 3] but the program uses it as torch.float32 [3, 4]"),
    "dtype": (lambda doc: _as_int32(doc), "stored as torch.int32"),
}


@pytest.fixture(scope="module")
def refusals(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The hostile files of the size-expression, weights and stride-0 tests, each in its own folder, and every
    CLI call on them run in one fresh memory-limited process (:func:`run_cli_many`); ``"dirs"`` holds the
    folders, ``"threat"`` whether torch's own loader ran the planted code (``"calls"``: the results by key)."""
    root = tmp_path_factory.mktemp("refusals")
    calls: dict[str, list[object]] = {}
    dirs: dict[str, Path] = {}
    threat: dict[str, bool] = {}
    for i, name in enumerate(HOSTILE_SIZES):
        d = dirs[f"size-{name}"] = root / f"size{i}"
        d.mkdir()
        marker = d / "pwned"
        expr = ESCAPES[name].replace(EXEC, f"(exec)({_chrs(f'open({str(marker)!r},chr(119))')})")
        path = rebuild(base, d / "sym.pt2", {P: json_edit(first_size(expr))})
        if name == "parenthesised callee":  # the threat is real: sympify runs it
            with contextlib.suppress(Exception):
                torch.export.load(str(path))
            threat[name] = marker.exists()
            marker.unlink(missing_ok=True)
        calls[f"size-{name}-convert"] = ["convert", path, "-o", d / "out.pt2"]
        calls[f"size-{name}-inspect"] = ["inspect", path]
    for case, (edit, _) in WEIGHT_EDITS.items():
        d = dirs[f"weights-{case}"] = root / f"weights-{case}"
        d.mkdir()
        path = rebuild(base, d / "w.pt2", {W: json_edit(edit)})
        calls[f"weights-{case}"] = ["convert", path, "-o", d / "out.pt2"]
    d = dirs["stride0-view"] = root / "stride0-view"
    d.mkdir()
    path = rebuild(base, d / "w.pt2", {W: json_edit(_stride0), P: json_edit(_stride0_program)})
    calls["stride0-view"] = ["convert", path, "-o", d / "out.pt2"]
    from tests.test_security import saved

    d = dirs["expanded"] = root / "expanded"
    d.mkdir()
    huge = torch.zeros(4).expand(300_000_000, 4)
    path = rebuild(base, d / "s.pt2", {"data/sample_inputs/model.pt": lambda _: saved(((huge,), {}))})
    calls["expanded"] = ["convert", path, "-o", d / "out.pt2"]
    return {"calls": run_cli_many(calls, root), "dirs": dirs, "threat": threat}


@pytest.mark.parametrize("name", HOSTILE_SIZES)
def test_hostile_size_expression_is_refused(name: str, refusals: dict[str, Any]) -> None:
    d = refusals["dirs"][f"size-{name}"]
    if name == "parenthesised callee":
        assert refusals["threat"][name]  # torch.export.load ran the planted code (the marker was written)
    for call in ("convert", "inspect"):
        assert_refused_call(refusals["calls"], f"size-{name}-{call}", "the size expression")
    assert not (d / "pwned").exists() and not (d / "out.pt2").exists()


def _chrs(text: str) -> str:
    """``text`` as ``(chr)(n)+(chr)(m)+...``: the form that walked around the old token rule."""
    return "+".join(f"(chr)({ord(c)})" for c in text)


# Case 2: guards are Python torch exec-s; amplite never loads them and never writes a loaded one out.
def test_guards_code_is_dropped_and_never_reaches_the_output(base: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    guard = f"(exec)({_chrs(f'open({str(marker)!r},chr(119))')}) is None"
    path = rebuild(base, tmp_path / "guard.pt2", {P: json_edit(lambda doc: doc.update(guards_code=[guard]))})
    program = load_program(path)
    assert program._guards_code == []
    program.module()(torch.randn(2, 4))
    res = amplite.convert(path, precision="bf16", level="O2")
    out = tmp_path / "out.pt2"
    res.save(out)
    assert not marker.exists()
    reloaded = torch.export.load(str(out))  # torch's own loader on amplite's output: nothing to run
    reloaded.module()(torch.randn(2, 4))
    assert not marker.exists() and "exec" not in json.dumps(reloaded._guards_code)


# Case 3: only operators a traced model contains; writes only to intermediates and buffers.
def _with_nodes(base: Path, dst: Path, build) -> Path:
    """``base`` re-saved with nodes ``build(graph, placeholders)`` inserted before the output."""
    ep = torch.export.load(str(base))
    graph = ep.graph
    out = next(n for n in graph.nodes if n.op == "output")
    phs = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    with graph.inserting_before(out):
        build(graph, phs)
    ep.graph_module.recompile()
    torch.export.save(ep, str(dst))
    return dst


def _node(graph: torch.fx.Graph, op, args, kwargs=None, val=None) -> torch.fx.Node:
    node = graph.call_function(op, args, kwargs or {})
    node.meta["val"] = val if val is not None else torch.empty(8, dtype=torch.uint8)
    return node


def test_from_file_overwrite_runs_with_torch_and_is_refused(base: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"A" * 8)

    def build(graph, _):
        f = _node(graph, torch.ops.aten.from_file.default, (str(victim),), {"shared": True, "size": 8,
                                                                          "dtype": torch.uint8})  # fmt: skip
        _node(graph, torch.ops.aten.fill_.Scalar, (f, 66))

    path = _with_nodes(base, tmp_path / "from_file.pt2", build)
    torch.export.load(str(path)).module()(torch.randn(2, 4))
    assert victim.read_bytes() == b"B" * 8  # the threat is real
    victim.write_bytes(b"A" * 8)
    calls = {"convert": ["convert", path, "-o", tmp_path / "out.pt2"], "inspect": ["inspect", path],
             "check": ["check", path, "--report", tmp_path / "report"]}  # fmt: skip
    got = run_cli_many(calls, cwd=tmp_path)
    for key in calls:
        assert_refused_call(got, key, "aten::from_file")
    assert victim.read_bytes() == b"A" * 8 and not (tmp_path / "out.pt2").exists()


WRITES = {
    "parameter": lambda g, p: _node(g, torch.ops.aten.fill_.Scalar, (p["p_lin_weight"], 0.0), val=torch.empty(3, 4)),
    "user input": lambda g, p: _node(g, torch.ops.aten.mul_.Tensor, (p["x"], 2.0), val=torch.empty(2, 4)),
    "constant": lambda g, p: _node(g, torch.ops.aten.zero_.default, (p["c_const"],), val=torch.empty(3)),
    "view of a parameter": lambda g, p: _node(
        g, torch.ops.aten.add_.Tensor,
        (_node(g, torch.ops.aten.view.default, (p["p_lin_weight"], [12]), val=torch.empty(12)), 1.0),
        val=torch.empty(12),
    ),
}


@pytest.mark.parametrize("what", sorted(WRITES))
def test_in_place_write_to_a_protected_input_is_refused(what: str, base: Path, tmp_path: Path) -> None:
    path = _with_nodes(base, tmp_path / "write.pt2", WRITES[what])
    with pytest.raises(LoadError, match="writes") as info:
        load_program(path)
    assert "\n" not in str(info.value)


def test_writes_to_buffers_and_intermediates_load(tmp_path: Path) -> None:
    """What training IR keeps (a counter buffer, relu_ on an intermediate) is not a false refusal."""

    class Stateful(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps.add_(1)
            return self.lin(x).relu_() + self.steps

    path = tmp_path / "stateful.pt2"
    torch.export.save(torch.export.export(Stateful(), (torch.randn(2, 4),)), str(path))
    x = torch.randn(2, 4)
    assert torch.equal(load_program(path).module()(x), torch.export.load(str(path)).module()(x))


@pytest.mark.parametrize(
    "op",
    [torch.ops.aten.from_file.default, torch.ops.aten._print.default, torch.ops.aten.set_.source_Storage],
    ids=str,
)
def test_effectful_aten_ops_are_refused(op) -> None:
    assert refusal(op) is not None


@pytest.mark.parametrize(
    "op",
    [torch.ops.aten.linear.default, torch.ops.aten.add_.Tensor, torch.ops.aten.sym_size.int,
     torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.__and__.Tensor,
     torch.ops.aten._assert_scalar.default, torch.ops.aten.copy_.default],
    ids=str,
)  # fmt: skip
def test_ops_export_writes_are_allowed(op) -> None:
    assert refusal(op) is None


def test_custom_namespace_needs_import() -> None:
    from torch._higher_order_ops import print as _  # noqa: F401 (registers the HOP)

    assert refusal(torch.ops.profiler._record_function_enter.default) is not None
    assert refusal(torch.ops.higher_order.print) is not None


def test_dunder_aten_op_in_a_program_loads(tmp_path: Path) -> None:
    """``aten::__and__`` (a checkpoint's attention mask) is an operator, not an attribute walk."""

    class Masked(torch.nn.Module):
        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return x * ((m > 0) & (m < 5))

    path = tmp_path / "and.pt2"
    args = (torch.randn(3), torch.tensor([1, 6, 2]))
    ep = torch.export.export(Masked(), args)
    assert any("__and__" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, str(path))
    assert torch.equal(load_program(path).module()(*args), Masked()(*args))


# Case 9: a view may not make more elements than its storage holds; weights match the graph's metadata.
HUGE = {"sizes": [{"as_int": 100_000}, {"as_int": 100_000}], "strides": [{"as_int": 0}, {"as_int": 0}]}


def _stride0(doc: dict) -> None:
    doc["config"]["lin.bias"]["tensor_meta"].update(HUGE)


def _stride0_program(doc: dict) -> None:  # the graph agrees, so only the view check stands in the way
    doc["graph_module"]["graph"]["tensor_values"]["p_lin_bias"].update(HUGE)


def _transposed(doc: dict) -> None:  # same bytes, the shape the graph does not use
    doc["config"]["lin.weight"]["tensor_meta"].update(
        sizes=[{"as_int": 4}, {"as_int": 3}], strides=[{"as_int": 3}, {"as_int": 1}]
    )


def _as_int32(doc: dict) -> None:
    from torch._export.serde.serialize import _TORCH_TO_SERIALIZE_DTYPE

    doc["config"]["lin.weight"]["tensor_meta"]["dtype"] = _TORCH_TO_SERIALIZE_DTYPE[torch.int32].value


@pytest.mark.parametrize("case", list(WEIGHT_EDITS))
def test_weights_must_match_the_program(case: str, refusals: dict[str, Any]) -> None:
    assert_refused_call(refusals["calls"], f"weights-{case}", WEIGHT_EDITS[case][1])
    assert not (refusals["dirs"][f"weights-{case}"] / "out.pt2").exists()


def test_stride0_view_the_program_agrees_with_is_refused(refusals: dict[str, Any]) -> None:
    assert_refused_call(refusals["calls"], "stride0-view", "stride-0 or overlapping view")
    assert not (refusals["dirs"]["stride0-view"] / "out.pt2").exists()


def test_expanded_example_input_is_refused(refusals: dict[str, Any]) -> None:
    assert_refused_call(refusals["calls"], "expanded", "stride-0 or overlapping view")
