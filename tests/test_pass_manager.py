"""X"""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from torch import nn

import amplite.ops  # noqa: F401  (registers amplite::contract)
from amplite.errors import ConfigError, InternalError
from amplite.passes.base import PassBase, PassManager, PassResult, call_function_nodes


class _AddOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + 1


def _traced() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(_AddOne())


class _Rewrite(PassBase):
    """Turns relu into sigmoid in the graph (without recompiling), reporting ``modified``."""

    name = "rewrite"

    def __init__(self, say_modified: bool = True) -> None:
        self.say_modified = say_modified

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        for n in call_function_nodes(gm):
            if n.target is torch.relu:
                n.target = torch.sigmoid
        return PassResult(gm, self.say_modified, Counter({"rewritten": 1}))


class _Noop(PassBase):
    name = "noop"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        return PassResult(gm, False)


class _Raise(PassBase):
    def __init__(self, exc: Exception, name: str = "crash") -> None:
        self.exc, self.name = exc, name

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        raise self.exc


class _Break(PassBase):
    """Leaves a node that reads an erased one: ``graph.lint()`` rejects it."""

    name = "break"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        add = next(iter(relu.users))
        add.args = (relu.args[0], 1)
        gm.graph.erase_node(relu)
        gm.graph.create_node("call_function", torch.neg, (relu,))  # reads the erased relu
        return PassResult(gm, True)


def test_pass_manager_records_each_pass_and_recompiles_once_after_a_change() -> None:
    """Records name, modified, counters (a plain dict), time and details ({} when none) per pass, in order;
    a pass that changed the graph (even if a later one did not) gets the module's code regenerated."""
    gm = _traced()
    x = torch.tensor([-1.0, 0.0, 2.0])
    out, records = PassManager([_Rewrite(), _Noop()])(gm)
    assert out is gm
    assert [(r.name, r.modified, r.counters, r.details) for r in records] == [
        ("rewrite", True, {"rewritten": 1}, {}),
        ("noop", False, {}, {}),
    ]
    assert all(type(r.counters) is dict and 0 <= r.seconds < 5 for r in records)
    torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)  # the regenerated code runs the sigmoid


def test_pass_manager_leaves_code_alone_when_no_pass_says_it_changed_the_graph() -> None:
    """No pass reports a change: the module's Python code is not regenerated (still runs relu)."""
    gm = _traced()
    x = torch.tensor([-1.0, 0.0, 2.0])
    PassManager([_Rewrite(say_modified=False)])(gm)
    torch.testing.assert_close(gm(x), torch.relu(x) + 1)


def test_pass_manager_lints_after_a_modifying_pass_unless_told_not_to() -> None:
    """A rewrite that leaves a dangling node is caught by the lint after that pass (lint=True, the default)."""
    with pytest.raises(RuntimeError):
        PassManager([_Break()])(_traced())
    _, (record,) = PassManager([_Break()], lint=False)(_traced())
    assert record.modified


def test_pass_manager_lint_default_is_on() -> None:
    """The constructor's default lints."""
    assert PassManager([]).lint is True and PassManager([], lint=False).lint is False


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (KeyError("boom"), "amplite bug: pass crash failed: KeyError: 'boom'"),
        (ValueError("  first line\nsecond line"), "amplite bug: pass crash failed: ValueError: first line"),
        (ValueError(""), "amplite bug: pass crash failed: ValueError: "),
        (ValueError("x" * 300), "amplite bug: pass crash failed: ValueError: " + "x" * 200),
    ],
)
def test_a_crashing_pass_is_reported_as_an_amplite_bug(exc: Exception, message: str) -> None:
    """A pass's own exception becomes InternalError naming the pass, the type and the message's first
    line (stripped, at most 200 characters), chained to the original."""
    with pytest.raises(InternalError) as info:
        PassManager([_Noop(), _Raise(exc)])(_traced())
    assert info.value.problem == message
    assert info.value.__cause__ is exc


def test_a_users_error_from_a_pass_passes_through_unchanged() -> None:
    """An AmpliteError (the user's problem, with its fix) is not rewrapped as an amplite bug."""
    err = ConfigError("bad option", "use another")
    with pytest.raises(ConfigError) as info:
        PassManager([_Raise(err)])(_traced())
    assert info.value is err


def test_call_function_nodes_is_an_ordered_snapshot() -> None:
    """Only call_function nodes, in graph order, as a list that erasing nodes does not disturb."""
    gm = _traced()
    nodes = call_function_nodes(gm)
    assert isinstance(nodes, list) and [n.target for n in nodes] == [torch.relu, operator.add]
    assert all(n.op == "call_function" for n in nodes)


class _Detailed(PassBase):
    """A pass whose result carries per-node details (as FusionResult does), or None for them."""

    name = "detailed"

    def __init__(self, details: object) -> None:
        self.details_value = details

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        res = PassResult(gm, False, Counter({"n": 2}))
        res.details = self.details_value  # type: ignore[attr-defined]
        return res


def test_pass_manager_keeps_a_results_details_for_the_report() -> None:
    """The record carries the result's details (a copy), {} when the result has None."""
    details = {"rejected": [{"node": "mm", "reason": "why"}]}
    _, (kept, empty) = PassManager([_Detailed(details), _Detailed(None)])(_traced())
    assert kept.details == details and kept.details is not details
    assert (empty.details, empty.counters) == ({}, {"n": 2})


class _Check(PassBase):
    """A postcondition check: raises ``exc`` when given one, else reports a counter."""

    name = "check"

    def __init__(self, exc: Exception | None = None) -> None:
        self.exc = exc

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        if self.exc is not None:
            raise self.exc
        return PassResult(gm, True, Counter({"checked": 1}))


def test_a_postconditions_record_follows_the_passes_and_never_says_modified() -> None:
    """The check's record comes last, with its counters and modified False whatever its result says (a check
    does not rewrite); names() and describe() list it last, and leave it out when there is none."""
    manager = PassManager([_Noop()], name="seq", postcondition=_Check())
    _, records = manager(_traced())
    assert [(r.name, r.modified, r.counters) for r in records] == [
        ("noop", False, {}),
        ("check", False, {"checked": 1}),
    ]
    assert manager.names() == ["noop", "check"] and manager.describe() == "seq: noop; ensures check"
    plain = PassManager([_Noop(), _Rewrite()])
    assert plain.names() == ["noop", "rewrite"] and plain.describe() == "passes: noop → rewrite"


def test_a_postconditions_finding_is_the_sequences_postcondition_error() -> None:
    """An InternalError the check raises becomes a PostconditionError of the sequence (by its name) whose
    condition is the finding without its 'amplite bug: ' prefix, chained to the finding's cause."""
    from amplite.passes.base import PostconditionError

    cause = ValueError("why")
    finding = InternalError("amplite bug: node mm reads a float32 value")
    finding.__cause__ = cause
    with pytest.raises(PostconditionError) as info:
        PassManager([_Noop()], name="precision", postcondition=_Check(finding))(_traced())
    assert (info.value.pass_name, info.value.condition) == ("precision", "node mm reads a float32 value")
    assert info.value.__cause__ is cause


def test_contract_errors_survive_pickling_with_their_kind() -> None:
    """Batch workers send errors back pickled: the type, the pass and the condition come through."""
    import pickle

    from amplite.passes.base import PostconditionError, PreconditionError

    for err in (PreconditionError("a", "x is unplanned"), PostconditionError("b", "y is cast twice")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and (back.pass_name, back.condition) == (err.pass_name, err.condition)
        assert str(back) == str(err)


class _NoEnsures:
    name = "half"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        return PassResult(gm, False)

    def requires(self, gm: torch.fx.GraphModule) -> None:
        return None


def _nameless(gm: torch.fx.GraphModule) -> PassResult:
    return PassResult(gm, False)


def test_a_pass_or_check_without_a_contract_is_refused_by_name() -> None:
    """A pass with requires but no ensures, a plain function (named by its repr) and a postcondition check
    without a contract are refused when the manager is built."""
    with pytest.raises(TypeError) as refused:
        PassManager([_NoEnsures()])
    assert str(refused.value) == "pass 'half' declares no requires/ensures: derive it from PassBase"
    with pytest.raises(TypeError) as info:
        PassManager([_Noop(), _nameless])
    assert str(info.value).startswith(f"pass {_nameless!r} declares no requires/ensures")
    with pytest.raises(TypeError, match="'half'"):
        PassManager([_Noop()], postcondition=_NoEnsures())


def test_require_planned_refuses_an_unplanned_node_and_ignores_the_output() -> None:
    """The passes after the plan need every node but the output to have a planned dtype (amplite's own casts
    are planned by construction)."""
    from amplite.passes.base import PreconditionError
    from amplite.passes.graph_utils import make_cast
    from amplite.passes.meta import OUT_DTYPE_KEY

    gm = _traced()
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    with gm.graph.inserting_after(relu):
        make_cast(gm.graph, relu, torch.float16)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[OUT_DTYPE_KEY] = torch.float32
    with pytest.raises(PreconditionError) as info:
        _Noop().require_planned(gm)
    assert info.value.condition == "node relu has no planned dtype: annotate_precision must run first"
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not torch.ops.aten._to_copy.default:
            node.meta[OUT_DTYPE_KEY] = torch.float32
    assert _Noop().require_planned(gm) is None
