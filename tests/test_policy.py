"""Policy decisions: levels, tables, overrides and their documented priority."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from amplite.errors import ConfigError
from amplite.levels import resolve_level
from amplite.passes.annotate_precision import AnnotatePrecision
from amplite.passes.meta import PRECISION_KEY
from amplite.policy import (
    BROADCAST_GATE,
    RESIDUAL_STREAM,
    Decision,
    Level,
    NodeFacts,
    Override,
    PrecisionPolicy,
    RuleSource,
    make_overrides,
)


def policy(level: str = "O1", keep: tuple[str, ...] = (), low: tuple[str, ...] = ()) -> PrecisionPolicy:
    return PrecisionPolicy("fp16", Level(level), make_overrides(keep, low))


@pytest.mark.parametrize(
    ("level", "op", "mode", "reason"),
    [
        ("O0", "linear.default", "fp32", "level:O0"),
        ("O1", "linear.default", "low", "low-list:linear"),
        ("O1", "softmax.int", "fp32", "fp32-list:softmax"),
        ("O1", "add.Tensor", "follow", "follow-inputs"),
        ("O2", "add.Tensor", "low", "level:O2"),
        ("O2", "layer_norm.default", "fp32", "fp32-list:norm"),
        ("O3", "layer_norm.default", "low", "level:O3"),
    ],
)
def test_level_rules(level: str, op: str, mode: str, reason: str) -> None:
    d = policy(level).decide(op, "enc.layer.0", "n")
    assert (d.mode, d.reason) == (mode, reason)


def test_override_priority_node_beats_module_beats_op() -> None:
    p = policy(keep=("op:linear",), low=("module:enc.*", "node:special"))
    assert p.decide("linear.default", "dec", "x").mode == "fp32"  # op rule
    assert p.decide("linear.default", "enc.layer.0", "x").mode == "low"  # module beats op
    p2 = policy(keep=("node:special",), low=("module:enc.*",))
    assert p2.decide("linear.default", "enc.layer.0", "special").reason == "user:keep node:special"


def test_keep_beats_force_low_at_the_same_rank() -> None:
    p = policy(keep=("module:enc.*",), low=("module:enc.layer.*",))
    d = p.decide("linear.default", "enc.layer.0", "x")
    assert (d.mode, d.reason) == ("fp32", "user:keep module:enc.*")


def test_module_glob_matches_the_module_itself_and_unprefixed_matches_any() -> None:
    assert policy(keep=("module:enc.*",)).decide("linear.default", "enc", "x").mode == "fp32"
    assert policy(keep=("softmax",)).decide("softmax.int", "", "x").reason == "user:keep softmax"
    assert policy(low=("softmax",)).decide("softmax.int", "", "x").mode == "low"


def test_overrides_ignored_at_o0() -> None:
    assert policy("O0", low=("op:*",)).decide("linear.default").mode == "fp32"


def test_level_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    assert resolve_level(None) is Level.O1
    monkeypatch.setenv("AMPLITE_LEVEL", "O2")
    assert resolve_level(None) is Level.O2
    assert resolve_level("O3") is Level.O3  # explicit argument wins
    monkeypatch.setenv("AMPLITE_LEVEL", "O9")
    with pytest.raises(ConfigError, match="AMPLITE_LEVEL"):
        resolve_level(None)


def test_unknown_level_and_precision_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown level"):
        resolve_level("O5")
    with pytest.raises(ConfigError, match="unknown precision"):
        PrecisionPolicy("fp8")


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
    # the message names the value and where it came from; the fix lists every level
    assert "'O9'" in info.value.problem and "--level" in info.value.problem
    assert info.value.fix.startswith("use ") and all(name in info.value.fix for name in ("O0", "O1", "O2", "O3"))
    monkeypatch.setenv("AMPLITE_LEVEL", "fast")
    with pytest.raises(ConfigError) as info:
        resolve_level(None)
    assert "'fast'" in info.value.problem and "AMPLITE_LEVEL" in info.value.problem
    assert all(name in info.value.fix for name in ("O0", "O1", "O2", "O3"))
    monkeypatch.setenv("AMPLITE_LEVEL", "")
    assert resolve_level(None) is Level.O1  # an empty variable is unset
    assert resolve_level(Level.O3) is Level.O3


def test_empty_override_pattern_message() -> None:
    from amplite.policy import make_overrides

    with pytest.raises(ConfigError) as info:
        make_overrides(keep_fp32=["op:"])
    assert "'op:'" in info.value.problem and "empty" in info.value.problem
    assert info.value.fix.endswith(" module:encoder.*")  # an example of a pattern that names something


def test_unknown_precision_in_policy_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        PrecisionPolicy("fp8")
    assert "'fp8'" in info.value.problem
    assert "fp16" in info.value.fix and "bf16" in info.value.fix and "fp8" not in info.value.fix


@pytest.mark.parametrize(
    ("level", "facts", "reason"),
    [
        # an amax-like normaliser feeding an FP32 op stays FP32 at O1/O2 only, and only when it feeds one
        ("O1", {"op": "amax.default", "feeds_fp32": True}, "fp32-list:normaliser-feeds-fp32"),
        ("O2", {"op": "max.dim", "feeds_fp32": True}, "fp32-list:normaliser-feeds-fp32"),
        ("O3", {"op": "amax.default", "feeds_fp32": True}, "level:O3"),
        ("O1", {"op": "amax.default"}, "follow-inputs"),
        ("O1", {"op": "add.Tensor", "feeds_fp32": True}, "follow-inputs"),
        # the + eps between two FP32 ops stays FP32 at O2 only; an FP32-list op keeps its own reason
        ("O2", {"op": "add.Tensor", "bridges_fp32": True}, "fp32-island-bridge"),
        ("O1", {"op": "add.Tensor", "bridges_fp32": True}, "follow-inputs"),
        ("O3", {"op": "add.Tensor", "bridges_fp32": True}, "level:O3"),
        ("O2", {"op": "softmax.int", "bridges_fp32": True}, "fp32-list:softmax"),
        # a residual add a norm reads: O1 and O2, add only
        ("O1", {"op": "add.Tensor", "feeds_norm": True}, "residual-stream"),
        ("O2", {"op": "add.Tensor", "feeds_norm": True}, "residual-stream"),
        ("O3", {"op": "add.Tensor", "feeds_norm": True}, "level:O3"),
        ("O2", {"op": "mul.Tensor", "feeds_norm": True}, "level:O2"),
        # a broadcast gate: O1 only, sigmoid-like ops only
        ("O1", {"op": "sigmoid.default", "broadcast_gate": True}, "broadcast-gate"),
        ("O1", {"op": "hardsigmoid.default", "broadcast_gate": True}, "broadcast-gate"),
        ("O2", {"op": "sigmoid.default", "broadcast_gate": True}, "level:O2"),
        ("O1", {"op": "mul.Tensor", "broadcast_gate": True}, "follow-inputs"),
        ("O1", {"op": "sigmoid.default"}, "follow-inputs"),
        ("O0", {"op": "add.Tensor", "feeds_norm": True, "bridges_fp32": True}, "level:O0"),
    ],
)
def test_structure_rules_fire_at_their_levels_and_ops_only(level: str, facts: dict, reason: str) -> None:
    d = policy(level).decide(NodeFacts(**facts, module="blk", node="n"))
    assert d.reason == reason
    assert d.mode == ("low" if reason in ("level:O2", "level:O3") else "follow" if reason == "follow-inputs"
                      else "fp32")  # fmt: skip
    structural = reason in ("fp32-list:normaliser-feeds-fp32", "fp32-island-bridge", RESIDUAL_STREAM, BROADCAST_GATE)
    assert (d.source is RuleSource.STRUCTURE) == structural


def test_unmatched_lists_the_users_rules_no_site_matches_through_the_module_prefix() -> None:
    user = make_overrides(["module:enc.*", "op:gelu"], ["node:n9"])
    pins = make_overrides(["op:softmax"], source="training")
    p = PrecisionPolicy("fp16", Level.O1, user + pins, module_prefix="lm.")
    left = p.unmatched([("linear.default", "lm.enc.0", "n1")])
    assert [o.pattern for o in left] == ["op:gelu", "node:n9"], "module rule matched after the prefix; pins never"
    assert p.unmatched([("gelu.default", "lm.enc.0", "n9"), ("add.Tensor", "lm.dec", "n2")]) == []
    assert [o.pattern for o in p.unmatched([])] == ["module:enc.*", "op:gelu", "node:n9"]


def test_user_module_strips_only_a_whole_prefix() -> None:
    p = PrecisionPolicy("fp16", Level.O1, module_prefix="lm.")
    assert (p.user_module("lm.enc.0"), p.user_module("lm"), p.user_module("other.x")) == ("enc.0", "", "other.x")
    assert PrecisionPolicy("fp16", Level.O1).user_module("lm.enc") == "lm.enc"


def test_override_from_a_non_override_layer_names_the_writers() -> None:
    with pytest.raises(ConfigError) as exc:
        Override("keep_fp32", "op:gelu", RuleSource.LEVEL)
    assert exc.value.fix.startswith("use one of: ")
    named = exc.value.fix.removeprefix("use one of: ").split(", ")
    assert set(named) == {s.value for s in RuleSource if s.is_override} and len(named) > 1


def test_make_overrides_labels_each_list_and_keeps_the_source() -> None:
    rules = make_overrides(["op:gelu"], ["op:linear"], source="training")
    assert [(r.action, r.source) for r in rules] == [("keep_fp32", RuleSource.TRAINING),
                                                     ("force_low", RuleSource.TRAINING)]  # fmt: skip
    keep = make_overrides(["op:gelu"])[0]
    with pytest.raises(ConfigError) as exc:
        make_overrides(force_low=[keep])
    assert "'op:gelu'" in exc.value.problem and "keep_fp32" in exc.value.problem
    assert exc.value.fix.startswith("pass it in its own list")


def test_a_level_given_as_text_is_the_level_the_rules_compare_by_identity() -> None:
    p = PrecisionPolicy("fp16", "o2")  # type: ignore[arg-type]
    assert p.level is Level.O2 and p.decide("add.Tensor").reason == "level:O2"


def test_an_op_decided_without_module_or_node_matches_no_module_or_node_rule() -> None:
    p = PrecisionPolicy("fp16", Level.O1, make_overrides(["module:X*", "node:X*"]))
    assert p.decide("add.Tensor").reason == "follow-inputs"
    assert p.decide("add.Tensor", "Xenc", "n").mode == "fp32" and p.decide("add.Tensor", "enc", "Xn").mode == "fp32"


@pytest.mark.parametrize(
    ("fp8", "decision", "no_kernel", "overflow", "want"),
    [
        ("static", Decision("low", "level:O2"), "", "", ("low", "fp8:static", RuleSource.LEVEL, True)),
        ("dynamic", Decision("low", "level:O2"), "", "", ("low", "fp8:dynamic", RuleSource.LEVEL, True)),
        ("static", Decision("low", "level:O2"), "no-weight-operand", "fp8-range:overflow 900",
         ("low", "fp8-kept:no-weight-operand", RuleSource.OP_TABLE, False)),
        ("static", Decision("low", "level:O2"), "", "fp8-range:overflow 900",
         ("low", "fp8-range:overflow 900", RuleSource.RANGE, False)),
        ("", Decision("low", "level:O2"), "", "", ("low", "level:O2", RuleSource.LEVEL, False)),
        ("static", Decision("fp32", "fp32-list:softmax", RuleSource.OP_TABLE), "", "",
         ("fp32", "fp32-list:softmax", RuleSource.OP_TABLE, False)),
        ("static", Decision("low", "user:low op:linear", RuleSource.USER), "", "",
         ("low", "user:low op:linear", RuleSource.USER, False)),
    ],
)  # fmt: skip
def test_for_fp8_runs_only_unpinned_low_products_in_fp8(
    fp8: str, decision: Decision, no_kernel: str, overflow: str, want: tuple
) -> None:
    d = PrecisionPolicy("fp16", Level.O2, fp8=fp8).for_fp8(decision, no_kernel, overflow)
    assert (d.mode, d.reason, d.source, d.fp8) == want


# --- the pass that reads the facts: overrides that match nothing, the structure facts ---------------------
# Graphs built by hand (milliseconds, no export): within the mutation run's per-mutant test budget.

aten = torch.ops.aten


def _call(graph: torch.fx.Graph, target: Any, *args: Any, module: str = "", **kwargs: Any) -> torch.fx.Node:
    """A ``call_function`` node whose value is ``target`` run on its arguments' values, from ``module``."""
    node = graph.call_function(target, args, kwargs)
    a, k = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = target(*a, **k)
    if module:
        node.meta["nn_module_stack"] = {module: (module, nn.Module)}
    return node


def _input(graph: torch.fx.Graph, name: str, value: torch.Tensor) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _model_of_many_names() -> torch.fx.GraphModule:
    """Seven ops (one a plain Python function) under seven module paths (the root, a private one, one outside
    the prefix ``lm.``), a cast and a ``getitem`` (neither is a site a pattern can name)."""
    g = torch.fx.Graph()
    x = _input(g, "x", torch.randn(2, 8))
    half = _call(g, aten._to_copy.default, x, dtype=torch.float16)
    top = _call(g, aten.max.dim, x, 1, module="lm.enc.0")
    r = _call(g, aten.relu.default, _call(g, operator.getitem, top, 0), module="lm.dec")
    t = _call(g, triple, r, module="lm._hidden")
    m = _call(g, aten.mul.Tensor, _call(g, aten.add.Tensor, t, r, module="lm"), r, module="other")
    sig = _call(g, aten.sigmoid.default, m, module="lm.a.b")
    g.output((_call(g, aten.tanh.default, sig, module="lm.dec.attn.q"), half))
    return torch.fx.GraphModule(nn.Module(), g)


def test_an_override_no_node_matches_is_refused_naming_the_models_modules_and_ops() -> None:
    rules = make_overrides(["module:nope.*"], ["op:nada"])
    with pytest.raises(ConfigError) as info:
        AnnotatePrecision(PrecisionPolicy("fp16", Level.O1, rules, module_prefix="lm."))(_model_of_many_names())
    problem, fix = info.value.problem, info.value.fix
    assert problem.startswith("--keep-fp32 'module:nope.*' matches no node of this model")
    assert problem.endswith(" (nor do 1 more patterns)"), problem
    assert fix.startswith("name what the model has (") and fix.endswith("; `amplite inspect MODEL` lists every node")
    # the user's names (prefix stripped; not the root's '' nor a private '_hidden'), shallowest first, at most 4
    assert "(modules dec, other, a.b, enc.0; " in fix, fix
    # the ops by name without overload, a Python function's own name; no cast, no getitem; at most 6
    assert "; ops add, max, mul, relu, sigmoid, tanh), " in fix, fix
    assert "e.g. module:dec.*; " in fix, fix
    planned = _model_of_many_names()
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O0, rules, module_prefix="lm."))(planned)  # O0 ignores them
    assert {n.meta[PRECISION_KEY]["reason"] for n in planned.graph.nodes if PRECISION_KEY in n.meta} == {"level:O0"}


def test_a_force_low_pattern_on_a_model_without_modules_suggests_an_op_or_linear_without_ops() -> None:
    g = torch.fx.Graph()
    x = _input(g, "x", torch.randn(2, 8))
    g.output(_call(g, aten.add.Tensor, _call(g, aten.relu.default, x), x))
    with pytest.raises(ConfigError) as info:
        AnnotatePrecision(policy("O2", low=("op:nada",)))(torch.fx.GraphModule(nn.Module(), g))
    problem, fix = info.value.problem, info.value.fix
    assert problem.startswith("--force-low 'op:nada' ") and problem.endswith("matches no node of this model"), problem
    assert fix.startswith("name what the model has (ops add, relu), e.g. op:add; "), fix
    g = torch.fx.Graph()
    g.output(_input(g, "x", torch.randn(2, 8)))
    with pytest.raises(ConfigError) as info:
        AnnotatePrecision(policy("O2", keep=("op:gelu",)))(torch.fx.GraphModule(nn.Module(), g))
    assert info.value.fix.startswith("name what the model has (ops ), e.g. op:linear; "), info.value.fix


def _decide(level: Level, build: Any, **kw: Any) -> dict[Any, Any]:
    """The plan (op -> mode, reason) of the graph ``build(graph)`` outputs."""
    g = torch.fx.Graph()
    g.output(build(g))
    gm = torch.fx.GraphModule(nn.Module(), g)
    AnnotatePrecision(PrecisionPolicy("fp16", level, **kw))(gm)
    return {n.target: (n.meta[PRECISION_KEY]["mode"], n.meta[PRECISION_KEY]["reason"]) for n in gm.graph.nodes
            if PRECISION_KEY in n.meta}  # fmt: skip


def test_the_pass_reads_the_residual_stream_gate_and_scalar_bridge_facts_off_the_graph() -> None:
    def residual(g: torch.fx.Graph) -> torch.fx.Node:
        x = _input(g, "x", torch.randn(2, 8))
        return _call(g, aten.layer_norm.default, _call(g, aten.add.Tensor, x, x), [8])

    def gate(g: torch.fx.Graph) -> torch.fx.Node:
        x = _input(g, "x", torch.randn(2, 4, 3, 3))
        pooled = _call(g, aten.mean.dim, x, [2, 3], True)
        return _call(g, aten.mul.Tensor, x, _call(g, aten.sigmoid.default, pooled))

    def loss(g: torch.fx.Graph) -> torch.fx.Node:
        return _call(g, aten.div.Tensor, _call(g, aten.sum.default, _input(g, "x", torch.randn(4))), 4.0)

    assert _decide(Level.O2, residual)[aten.add.Tensor] == ("fp32", RESIDUAL_STREAM)
    assert _decide(Level.O1, gate)[aten.sigmoid.default] == ("fp32", BROADCAST_GATE)
    # a 0-dim op between an FP32 reduction and an FP32 graph output stays FP32, unless outputs may go low
    assert _decide(Level.O2, loss)[aten.div.Tensor] == ("fp32", "fp32-island-bridge")
    assert _decide(Level.O2, loss, low_precision_io=True)[aten.div.Tensor] == ("low", "level:O2")
