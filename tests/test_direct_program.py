"""The directly built converted program (issue 17) equals the re-exported one, and survives save/load.

For every test fixture at O1 (static) and O2 (dynamic batch), fp16 and bf16 alternating from one
fixture to the next, a model with BatchNorm buffers, a non-persistent buffer, a lifted tensor constant and
tied weights in both precisions at both levels, and O3 (low-precision I/O, fp16) on three of them, the
pipeline's default (direct) program is compared with ``reexport=True``: the same computing nodes in the
same order with the same dtypes (ignoring the unused ``getitem`` re-export adds for a multi-output op),
the same graph signature (kinds and targets), bit-identical outputs on inputs the conversion never saw
(a larger batch where the batch is dynamic), the same input guards; and the direct programs, saved with
``torch.export.save``, load in one fresh process and reproduce those outputs exactly.
"""

from __future__ import annotations

import operator
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from amplite.converter.pipeline import lower_inputs, run_pipeline
from amplite.converter.tracing import export_model
from amplite.spec import ConvertSpec
from fixtures.zoo import TEST_FIXTURES, make
from tests import fresh

#: Each fixture at O1 (static) and O2 (dynamic batch), the two precisions swapped from one fixture to the
#: next (building the program is dtype-agnostic; both dtypes still meet both levels); the stateful model,
#: whose buffers and constants are what the direct build must carry, in all four.
_PAIRS = ((("fp16", "O1"), ("bf16", "O2")), (("bf16", "O1"), ("fp16", "O2")))
CASES = [(n, p, lvl) for i, n in enumerate(TEST_FIXTURES) for p, lvl in _PAIRS[i % 2]]
CASES += [("stateful", p, lvl) for p in ("fp16", "bf16") for lvl in ("O1", "O2")]
CASES += [(n, "fp16", "O3") for n in ("mlp", "transformer", "stateful")]


class Stateful(nn.Module):
    """Buffers (BatchNorm's, a non-persistent one), a plain tensor attribute and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)
        self.register_buffer("shift", torch.randn(16))
        self.table = torch.randn(16)  # not a buffer: export lifts it as a tensor constant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(self.emb(ids).mean(1))) * self.scale + self.shift + self.table
        return self.head(h)


def _make(name: str) -> tuple[nn.Module, Any]:
    if name != "stateful":
        return make(name)
    torch.manual_seed(0)
    model = Stateful().eval()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    return model, ((torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0)),), {})


def _fresh(inputs: Any, batch: int | None) -> Any:
    """New values like ``inputs`` (ids stay in range); dim 0 set to ``batch`` when given."""
    g = torch.Generator().manual_seed(123)

    def new(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        shape = (batch, *x.shape[1:]) if batch is not None and x.dim() else tuple(x.shape)
        if x.is_floating_point():
            return torch.randn(shape, generator=g).to(x.dtype)
        return torch.randint(0, int(x.max()) + 1, shape, generator=g, dtype=x.dtype)

    return pytree.tree_map(new, inputs)


def _nodes(program: torch.export.ExportedProgram) -> list[tuple[str, Any]]:
    out = []
    for n in program.graph.nodes:
        if n.op != "call_function" or (n.target is operator.getitem and not n.users):
            continue
        val = n.meta.get("val")
        out.append((str(n.target), pytree.tree_map(lambda v: getattr(v, "dtype", None), val)))
    return out


def _signature(program: torch.export.ExportedProgram) -> tuple[list, list]:
    sig = program.graph_signature
    ins = [(s.kind.name, s.target, s.persistent) for s in sig.input_specs]
    return ins, [(s.kind.name, s.target) for s in sig.output_specs]


def _spec(precision: str, level: str, **kw: Any) -> ConvertSpec:
    """The spec these tests convert with: no range rules, no fusion (the plan alone decides)."""
    return ConvertSpec.build(precision=precision, level=level, range_rules=False, fuse_contractions=False, **kw)


def _run(program: torch.export.ExportedProgram, inputs: Any) -> list[torch.Tensor] | str:
    args, kwargs = inputs
    try:
        with torch.no_grad():
            return pytree.tree_leaves(program.module()(*args, **kwargs))
    except Exception as exc:  # the input guards refused the inputs
        return type(exc).__name__


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each case converted both ways (one FP32 export per fixture and batch mode), the direct one saved."""
    root = tmp_path_factory.mktemp("direct")
    exported: dict[tuple[str, bool], Any] = {}
    cases = {}
    for i, (name, precision, level) in enumerate(CASES):
        model, inputs = _make(name)
        dynamic = level == "O2"
        if (name, dynamic) not in exported:
            exported[(name, dynamic)] = export_model(model, inputs, dynamic_batch=dynamic)
        # the stateful model keeps BatchNorm's buffers; a program passed in is re-exported with the same dims
        spec = _spec(precision, level, low_precision_io=level == "O3", fold_batchnorm=name != "stateful",
                     dynamic_batch=dynamic)  # fmt: skip
        policy = spec.policy()
        direct = run_pipeline(exported[(name, dynamic)], inputs, spec)
        again = run_pipeline(exported[(name, dynamic)], inputs, spec, reexport=True)
        batch = int(pytree.tree_leaves(inputs)[0].shape[0])
        new = _fresh(inputs, batch + 3 if dynamic else None)
        if policy.low_precision_io:
            new = lower_inputs(new, policy.low_dtype)
        path = root / f"{i}.pt2"
        torch.export.save(direct.converted, path)
        torch.save(new, root / f"{i}.inputs.pt")
        cases[(name, precision, level)] = {"direct": direct, "again": again, "inputs": new, "path": path,
                                           "wrong": _fresh(inputs, batch + 1)}  # fmt: skip
    return cases


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_direct_program_equals_reexport(built: dict, case: tuple[str, str, str]) -> None:
    c = built[case]
    direct, again = c["direct"], c["again"]
    assert direct.build == {"path": "direct", "reason": ""}, direct.build
    assert again.build["path"] == "reexport"
    assert direct.timings["rebuild"] > 0 and direct.timings["reexport"] == 0.0 < again.timings["reexport"]
    assert _signature(direct.converted) == _signature(again.converted)
    # the same ops in the same dtypes; independent nodes (a sym_size beside an input cast) may come in either order
    assert sorted(map(str, _nodes(direct.converted))) == sorted(map(str, _nodes(again.converted)))
    a, b = direct.converted, again.converted
    assert {k: (v.dtype, v.shape) for k, v in a.state_dict.items()} == {
        k: (v.dtype, v.shape) for k, v in b.state_dict.items()
    }
    assert sorted(a.constants) == sorted(b.constants) or len(a.constants) == len(b.constants)
    got, want = _run(a, c["inputs"]), _run(b, c["inputs"])
    assert not isinstance(want, str), want
    assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    if case[2] != "O2":  # static batch: both programs' guards refuse another batch size alike
        assert isinstance(_run(b, c["wrong"]), str) == isinstance(_run(a, c["wrong"]), str)


_LOADER = """
import sys, torch
from torch.utils import _pytree as pytree
for path, inputs, expected in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    args, kwargs = torch.load(inputs)
    with torch.no_grad():
        out = pytree.tree_leaves(torch.export.load(path).module()(*args, **kwargs))
    want = torch.load(expected)
    assert len(out) == len(want) and all(torch.equal(o, w) for o, w in zip(out, want)), path
    print("ok", path)
"""


def test_direct_programs_load_and_run_in_a_fresh_process(built: dict) -> None:
    argv = []
    for c in built.values():
        expected = c["path"].with_suffix(".expected.pt")
        torch.save(_run(c["again"].converted, c["inputs"]), expected)
        argv += [str(c["path"]), str(c["path"].with_suffix(".inputs.pt")), str(expected)]
    done = fresh.run([sys.executable, "-c", textwrap.dedent(_LOADER), *argv], timeout=300,
                     cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == len(built)


def test_reexport_is_the_fallback_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = make("mlp")
    policy = _spec("fp16", "O2")
    monkeypatch.setenv("AMPLITE_REEXPORT", "1")
    forced = run_pipeline(model, inputs, policy)
    assert forced.build["path"] == "reexport" and "forced" in forced.build["reason"]
    monkeypatch.delenv("AMPLITE_REEXPORT")

    def broken(*_a: Any, **_k: Any) -> Any:
        from amplite.converter.direct import NotDirect

        raise NotDirect("a case lifting does not handle")

    monkeypatch.setattr("amplite.converter.pipeline.lift", broken)
    out = run_pipeline(model, inputs, policy)
    assert out.build == {"path": "reexport", "reason": "a case lifting does not handle"}
    record = out.records[-1]
    assert record.name == "build_program" and record.counters.items() >= {"direct": 0, "reexport": 1}.items()
    assert record.details == {"fallback": [{"reason": "a case lifting does not handle"}]}
    assert out.timings["reexport"] > 0
    got, want = _run(out.converted, inputs), _run(forced.converted, inputs)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_a_buffer_written_in_place_keeps_its_in_graph_mutation() -> None:
    """Training-IR programs keep in-place ops on buffers in the graph: the direct program keeps them too."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.fc(x) + self.calls

    inputs = ((torch.randn(2, 8),), {})
    direct = run_pipeline(Counter().eval(), inputs, _spec("fp16", "O2"))
    again = run_pipeline(Counter().eval(), inputs, _spec("fp16", "O2"), reexport=True)
    assert direct.build["path"] == "direct"
    assert _signature(direct.converted) == _signature(again.converted)
    # the same ops in the same dtypes; independent nodes (a sym_size beside an input cast) may come in either order
    assert sorted(map(str, _nodes(direct.converted))) == sorted(map(str, _nodes(again.converted)))
    module = direct.converted.module()
    first, second = module(*inputs[0]), module(*inputs[0])
    assert torch.allclose(second - first, torch.ones_like(first), atol=0.02)  # the buffer counts calls


def test_the_report_says_which_path_built_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    import amplite

    model, inputs = _make("mlp")
    direct = amplite.convert(model, inputs, precision="fp16", level="O1", verify=False).report.data["build"]
    assert direct == {"path": "direct", "reason": ""}, f"the direct build was not reported: {direct}"
    monkeypatch.setenv("AMPLITE_REEXPORT", "1")
    forced = amplite.convert(model, inputs, precision="fp16", level="O1", verify=False).report.data["build"]
    assert forced["path"] == "reexport" and "AMPLITE_REEXPORT" in forced["reason"], forced
