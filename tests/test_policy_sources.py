"""Every precision decision names the policy layer that made it; code reads that field, never the reason text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import amplite
from amplite.errors import ConfigError
from amplite.policy import Decision, Level, Override, PrecisionPolicy, RuleSource, make_overrides
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
    assert all(p["rule"] == "training" and p["reason"] == "training:keep op:batch_norm*" for p in bn), bn[0]
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


def test_pins_beat_graph_rules_and_rules_keep_their_priority() -> None:
    budget = Override("force_low", "node:n", RuleSource.BUDGET)
    policy = PrecisionPolicy("fp16", Level.O2, (budget,))
    pinned = policy.decide("linear.default", "", "n")
    assert pinned == Decision("low", "budget:low node:n", RuleSource.BUDGET) and pinned.pinned
    # A range flag, a discrete decision and a normaliser rule leave a pin alone, and move an unpinned op.
    assert policy.for_range(pinned, "range:activation") is pinned
    assert policy.for_discrete_decision(pinned) is pinned
    assert policy.for_normaliser(pinned, feeds_fp32=True) is pinned
    free = policy.decide("linear.default", "", "m")
    assert free.source is RuleSource.LEVEL and not free.pinned
    assert policy.for_range(free, "range:activation") == Decision("fp32", "range:activation", RuleSource.RANGE)
    assert policy.for_bridge(free, bridges_fp32=True).source is RuleSource.STRUCTURE
    assert policy.for_bridge(free, bridges_fp32=False) is free
    order = [RuleSource.DTYPE, RuleSource.USER, RuleSource.RANGE, RuleSource.FIDELITY, RuleSource.STRUCTURE,
             RuleSource.OP_TABLE, RuleSource.LEVEL]  # fmt: skip
    assert [Decision("low", "", s).priority for s in order] == sorted(Decision("low", "", s).priority for s in order)
    # O1 has no bridge rule and O3 no graph rules at all.
    o1 = PrecisionPolicy("fp16", Level.O1)
    assert o1.for_bridge(Decision("low", "level:O2", RuleSource.LEVEL), True).mode == "low"
    o3 = PrecisionPolicy("fp16", Level.O3)
    assert o3.for_normaliser(o3.decide("amax.default"), True).mode == "low"


def test_no_control_flow_reads_a_reason_string() -> None:
    """Decisions are read from ``Decision.source`` / the report's ``rule``; a reason is for people only."""
    offenders = []
    # Everything that makes, moves or reads precision decisions (batch job statuses and the codemod's
    # reasons are other vocabularies).
    areas = [
        "policy.py",
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
