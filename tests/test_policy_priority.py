"""Property probes of the policy's precedence: ``decide`` takes the first answer of ``LAYERS`` in ``PRIORITY``
order, so a lower-priority layer can never overwrite a higher one, on random facts and for every pair of
layers; and docs/policy.md quotes the priority table the code holds."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amplite import op_tables, policy
from amplite.decisions import PRIORITY, Decision, Override, RuleSource
from amplite.policy import LAYERS, Level, NodeFacts, PrecisionPolicy

ROOT = Path(__file__).resolve().parents[1]
_TABLED = {*op_tables.LOW_PRECISION_OPS, *itertools.chain.from_iterable(op_tables.FP32_OPS.values())}
_OPS = [*sorted(_TABLED)[:60], "add.Tensor", "topk.default", "pow.Tensor_Scalar", "unknown_op.default"]
_NAMES = ["n0", "n1", "enc.q", "head"]

facts_st = st.builds(
    NodeFacts,
    op=st.sampled_from(_OPS),
    module=st.sampled_from(["", "enc", "enc.attn", "head"]),
    node=st.sampled_from(_NAMES),
    range_flag=st.sampled_from(["", "range:activation |x|=9e4>512", "range:constant 1e9>65504"]),
    range_cleared=st.sampled_from(["", "small-integer-pow"]),
    fp32_reader=st.booleans(),
    discrete=st.booleans(),
    feeds_fp32=st.booleans(),
    bridges_fp32=st.booleans(),
    feeds_norm=st.booleans(),
)
override_st = st.builds(
    Override,
    action=st.sampled_from(["keep_fp32", "force_low"]),
    pattern=st.sampled_from([f"node:{n}" for n in _NAMES] + ["op:softmax", "module:enc.*", "op:linear"]),
    source=st.sampled_from([s for s in RuleSource if s.is_override]),
)
policy_st = st.builds(
    PrecisionPolicy,
    precision=st.sampled_from(["fp16", "bf16"]),
    level=st.sampled_from([Level.O1, Level.O2, Level.O3]),
    overrides=st.lists(override_st, max_size=3).map(tuple),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pol=policy_st, facts=facts_st)
def test_random_facts_the_decision_is_the_strongest_answer_and_no_weaker_layer_overwrites_it(
    pol: PrecisionPolicy, facts: NodeFacts
) -> None:
    """For random facts and policies: every pair of layers that both answer, the stronger one's answer is
    the decision (so the weaker one's never is, unless both say the same)."""
    answers = [(source, rule(pol, facts)) for source, rule in LAYERS]
    decided = pol.decide(facts)
    answered = [(s, d) for s, d in answers if d is not None]
    assert answered, "the level layer answers for every op"
    assert decided == answered[0][1]
    for (hi, a), (lo, b) in itertools.combinations(answered, 2):
        assert PRIORITY[hi] <= PRIORITY[lo]
        assert decided.priority <= PRIORITY[a.source] <= PRIORITY[b.source], f"{lo.value} overwrote {hi.value}"


def _stub_layers(answering: set[int]) -> tuple:
    """``LAYERS`` with the real sources, each rule answering (with its own source) only if in ``answering``."""

    def rule(i: int, source: RuleSource):
        return lambda _p, _f: Decision("fp32" if i % 2 else "low", f"stub:{i}", source) if i in answering else None

    return tuple((source, rule(i, source)) for i, (source, _) in enumerate(LAYERS))


@pytest.mark.parametrize(("hi", "lo"), list(itertools.combinations(range(len(LAYERS)), 2)))
def test_every_pair_of_layers_the_higher_priority_one_decides(
    monkeypatch: pytest.MonkeyPatch, hi: int, lo: int
) -> None:
    """Only two layers answer: ``decide`` returns the one earlier in PRIORITY order, whichever pair."""
    monkeypatch.setattr(policy, "LAYERS", _stub_layers({hi, lo}))
    decided = PrecisionPolicy("fp16", Level.O2).decide(NodeFacts("add.Tensor"))
    assert decided.reason == f"stub:{hi}" and decided.source is LAYERS[hi][0]
    assert PRIORITY[LAYERS[hi][0]] < PRIORITY[LAYERS[lo][0]]


@settings(max_examples=100, deadline=None)
@given(answering=st.sets(st.integers(0, len(LAYERS) - 1), min_size=1))
def test_any_set_of_answering_layers_the_strongest_decides(answering: set[int]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy, "LAYERS", _stub_layers(answering))
        decided = PrecisionPolicy("fp16", Level.O1).decide(NodeFacts("add.Tensor"))
    assert decided.reason == f"stub:{min(answering)}"
    assert decided.priority == min(PRIORITY[LAYERS[i][0]] for i in answering)


def test_layers_run_in_priority_order_and_docs_quote_the_code_s_table() -> None:
    """One statement of the priority (``PRIORITY``), the order of ``LAYERS`` follows it, and docs/policy.md's
    table quotes it row for row."""
    ranks = [PRIORITY[s] for s, _ in LAYERS]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    text = (ROOT / "docs" / "policy.md").read_text()
    rows = re.findall(r"^\| (`[^|]+`) \| (\d+) \|", text, flags=re.M)
    documented = {name.strip("` "): int(rank) for cell, rank in rows for name in cell.split(",")}
    assert documented == {s.value: p for s, p in PRIORITY.items()}
