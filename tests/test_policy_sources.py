"""Every precision decision names the policy layer that made it; code reads that field, never the reason text."""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import amplite
from amplite.errors import ConfigError
from amplite.policy import (
    LAYERS,
    PRIORITY,
    Decision,
    Level,
    NodeFacts,
    Override,
    PrecisionPolicy,
    RuleSource,
    make_overrides,
)
from fixtures.zoo import make

ROOT = Path(__file__).resolve().parents[1]


def _plan(result) -> dict[str, dict]:
    return {p["node"]: p for p in result.report.data["plan"]}


def test_plan_entries_carry_the_deciding_layer_at_o1_and_o2() -> None:
    model, inputs = make("transformer")
    o1 = _plan(amplite.convert(model, inputs, level="O1", verify=False, keep_fp32=["op:gelu"]))
    by_op = {}
    for entry in o1.values():
        by_op.setdefault(entry["op"].split(".")[0], set()).add((entry["rule"], entry["reason"].split(":")[0]))
    assert by_op["gelu"] == {("user", "user")}, "the user's pin is the user's"
    assert by_op["linear"] == {("op-table", "low-list")}
    assert (by_op.get("softmax") or by_op["_softmax"]) == {("op-table", "fp32-list")}
    o2 = _plan(amplite.convert(model, inputs, level="O2", verify=False))
    assert {e["rule"] for e in o2.values() if e["reason"] == "level:O2"} == {"level"}
    rms, rms_inputs = make("rmsnorm")  # pow -> mean -> (+ eps) -> rsqrt, written out
    bridges = [e for e in _plan(amplite.convert(rms, rms_inputs, level="O2", verify=False)).values()
               if e["reason"] == "fp32-island-bridge"]  # fmt: skip
    assert bridges and {e["rule"] for e in bridges} == {"structure"}, "the + eps between mean and rsqrt"


def test_training_pins_are_reported_as_training_not_user() -> None:
    model, inputs = make("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net, _ = amplite.prepare_training(model, opt, inputs[0][0], precision="bf16", level="O2")
    bn = [p for p in net.info["plan"] if p["op"].startswith(("batch_norm", "_native_batch_norm", "native_batch_norm"))]
    assert bn, "the CNN fixture has BatchNorm"
    assert all(p["rule"] == "training" and p["reason"] == "training:low op:batch_norm*" for p in bn), bn[0]
    assert not any(p["reason"].startswith("user:") for p in net.info["plan"]), "the user wrote no rule"


def test_override_sources_are_typed_and_only_pins_may_write_rules() -> None:
    assert Override("keep_fp32", "node:x", "budget").source is RuleSource.BUDGET
    with pytest.raises(ConfigError, match="cannot come from 'level'"):
        Override("keep_fp32", "node:x", "level")
    with pytest.raises(ConfigError, match="cannot come from"):
        Override("keep_fp32", "node:x", "nobody")
    pin = Override("keep_fp32", "node:linear", RuleSource.BUDGET, why="isolated-error")
    rules = make_overrides(["op:softmax", pin])
    assert [r.source for r in rules] == [RuleSource.USER, RuleSource.BUDGET]
    with pytest.raises(ConfigError, match="own list"):
        make_overrides(force_low=[pin])


def _all_facts() -> list[NodeFacts]:
    """Every combination of graph facts, on ops from each table (FP32 list, low list, normaliser, other)."""
    flags = list(itertools.product(["", "range:activation x"], ["", "range:small-integer-pow"], *[[False, True]] * 4))
    ops = ["pow.Tensor_Scalar", "linear.default", "amax.default", "add.Tensor", "topk.default"]
    return [
        NodeFacts(op, "enc", name, flag, cleared, reader, discrete, feeds, bridges)
        for op in ops
        for name in ("n", "m")
        for flag, cleared, reader, discrete, feeds, bridges in flags
    ]


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_weaker_layer_never_overwrites_a_stronger_one(level: str) -> None:
    """The probe: for every combination of facts, the decision is the first answering layer's in priority
    order, and no layer below it (lower priority) could have produced it instead."""
    budget = Override("force_low", "node:n", RuleSource.BUDGET)
    policy = PrecisionPolicy("fp16", Level(level), (budget,))
    assert [PRIORITY[s] for s, _ in LAYERS] == sorted(PRIORITY[s] for s, _ in LAYERS), "layers in priority order"
    seen = set()
    for facts in _all_facts():
        answers = [(source, rule(policy, facts)) for source, rule in LAYERS]
        decided = policy.decide(facts)
        first_source, first = next((s, d) for s, d in answers if d is not None)
        assert decided == first, facts
        assert PRIORITY[decided.source] == PRIORITY[first_source]
        # every layer that also answered is weaker (or the same rank) and did not win
        assert all(PRIORITY[d.source] >= decided.priority for _, d in answers if d is not None)
        seen.add(decided.source)
    if level != "O3":  # O3 runs no graph rule; at O1/O2 every layer decides some combination
        assert {RuleSource.BUDGET, RuleSource.RANGE, RuleSource.FIDELITY, RuleSource.STRUCTURE} <= seen


def test_range_decision_is_not_overwritten_by_a_structure_rule() -> None:
    """The defect the layered policy fixes: an ``amax`` range_guard flagged, feeding an FP32 op, was reported
    as the normaliser's (structure, 4) decision over range's (2)."""
    policy = PrecisionPolicy("fp16", Level.O2)
    facts = NodeFacts("amax.default", range_flag="range:activation output |x|=9e4>512", feeds_fp32=True)
    assert policy.decide(facts) == Decision("fp32", facts.range_flag, RuleSource.RANGE)
    assert policy.decide(replace(facts, range_flag="")).source is RuleSource.STRUCTURE


def test_pins_beat_graph_rules_and_o3_has_none() -> None:
    budget = Override("force_low", "node:n", RuleSource.BUDGET)
    policy = PrecisionPolicy("fp16", Level.O2, (budget,))
    hot = {"range_flag": "range:activation", "discrete": True, "feeds_fp32": True, "bridges_fp32": True}
    pinned = policy.decide(NodeFacts("amax.default", node="n", **hot))
    assert pinned == Decision("low", "budget:low node:n", RuleSource.BUDGET) and pinned.pinned
    free = policy.decide(NodeFacts("linear.default", node="m"))
    assert free.source is RuleSource.LEVEL and not free.pinned
    assert policy.decide(NodeFacts("add.Tensor", bridges_fp32=True)).source is RuleSource.STRUCTURE
    assert PrecisionPolicy("fp16", Level.O1).decide(NodeFacts("add.Tensor", bridges_fp32=True)).mode == "follow"
    o3 = PrecisionPolicy("fp16", Level.O3)
    assert o3.decide(NodeFacts("amax.default", discrete=True, feeds_fp32=True)).mode == "low"


def test_docs_quote_the_priority_table_of_the_code() -> None:
    """docs/policy.md's layer table is the code's PRIORITY, row for row (one statement, quoted)."""
    text = (ROOT / "docs" / "policy.md").read_text()
    rows = re.findall(r"^\| (`[^|]+`) \| (\d+) \|", text, flags=re.M)
    documented = {name.strip("` "): int(prio) for cell, prio in rows for name in cell.split(",")}
    assert documented == {s.value: p for s, p in PRIORITY.items()}


def test_no_control_flow_reads_a_reason_string() -> None:
    """Decisions are read from ``Decision.source`` / the report's ``rule``; a reason is for people only."""
    offenders = []
    # Everything that makes, moves or reads precision decisions (batch job statuses and the codemod's
    # reasons are other vocabularies).
    areas = [
        "policy.py",
        "decisions.py",
        "api.py",
        "spec.py",
        "gate",
        "passes",
        "converter",
        "verify",
        "report",
        "training",
        "checkpoint",
    ]
    paths = [
        p
        for a in areas
        for p in ([ROOT / "amplite" / a] if a.endswith(".py") else (ROOT / "amplite" / a).rglob("*.py"))
    ]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("startswith", "endswith"):
                text = ast.unparse(node.func.value)
                if "reason" in text:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if (
                isinstance(node, ast.Compare)
                and "reason" in ast.unparse(node.left)
                and any(
                    isinstance(c, ast.Constant) and isinstance(c.value, str) and ":" in c.value
                    for c in node.comparators
                )
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_passes_use_only_declared_meta_keys() -> None:
    """Every ``amplite_*`` node.meta key is declared in ``amplite/passes/meta.py``; none is spelled as a string
    anywhere else, so a pass cannot read a key no pass writes (or write one that no one documents)."""
    from amplite.passes import meta

    root = Path(amplite.__file__).parent
    declared = set(meta.KEYS)
    assert all(k.startswith("amplite_") for k in declared)
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "meta.py" and path.parent.name == "passes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in declared:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
            # a subscript or .get/.pop of node.meta with an undeclared amplite_ key
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
                if isinstance(key, str) and key.startswith("amplite_") and ast.unparse(node.value).endswith("meta"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: undeclared {key!r}")
    assert not offenders, offenders


def test_the_precision_annotation_has_its_declared_fields() -> None:
    """annotate_precision writes one PrecisionAnnotation per computing node: exactly the declared fields, with
    a dtype for every float op and a rule that names a RuleSource."""
    from typing import get_type_hints

    from amplite.converter.pipeline import strip_export_checks
    from amplite.passes.annotate_precision import AnnotatePrecision
    from amplite.passes.meta import PRECISION_KEY, PrecisionAnnotation

    model, inputs = make("mlp")
    gm = torch.export.export(model, *inputs, strict=False).module()
    strip_export_checks(gm)
    AnnotatePrecision(PrecisionPolicy("fp16", Level.O1))(gm)
    entries = [n.meta[PRECISION_KEY] for n in gm.graph.nodes if PRECISION_KEY in n.meta]
    assert len(entries) >= 3
    fields = set(get_type_hints(PrecisionAnnotation))
    assert fields == {"mode", "dtype", "reason", "rule"}
    for e in entries:
        assert set(e) == fields and e["mode"] in ("low", "fp32", "follow")
        assert RuleSource(e["rule"]) in RuleSource and isinstance(e["reason"], str) and e["reason"]
    assert {e["dtype"] for e in entries if e["mode"] == "low"} == {torch.float16}
