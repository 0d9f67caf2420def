"""Issue 47 item 3: O2 on an EVA-02-like transformer (rotary q/k, SwiGLU with sub-LN, layer scale, small
init) stays near O1 — the residual stream's adds stay FP32 at O2 — and the budget search's reported trial
bound holds."""

from __future__ import annotations

import math

import pytest
import torch

import amplite
from amplite.verify.compare import parse_tolerance
from tests.test_budget import Cancellation
from tests.zoo_models import EvaLike

#: O2 may trail O1 by this much on the EVA-like model (bf16; measured 1.9 dB: the rotary products, computed
#: low at O2 and FP32 at O1, are the rest). Before the residual-stream rule it trailed by 8.8 dB.
O2_MARGIN_DB = 2.5


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return 20 * math.log10(float(ref.norm()) / float((ref - out).norm()))


@pytest.fixture(scope="module")
def eva() -> tuple[torch.nn.Module, tuple, torch.export.ExportedProgram]:
    """The model, its inputs and its program: traced once, converted at each level and pin (a conversion
    leaves the program it is given as it was)."""
    torch.manual_seed(0)
    model, inputs = EvaLike().eval(), ((torch.randn(2, 3, 32, 32),), {})
    return model, inputs, torch.export.export(model, *inputs, strict=False)


def test_o2_stays_within_the_margin_of_o1_on_an_eva_like_transformer(eva) -> None:
    model, inputs, program = eva
    with torch.no_grad():
        ref = model(*inputs[0])
    got, plans = {}, {}
    for level in ("O1", "O2"):
        result = amplite.convert(program, inputs, precision="bf16", level=level, verify=False)
        with torch.no_grad():
            got[level] = _sqnr(ref, result.module()(*inputs[0]).float())
        plans[level] = result.report.data["plan"]
    plan = plans["O2"]
    assert got["O1"] > 45, got  # the model is a fair test: O1 is as good as autocast on it
    assert got["O2"] >= got["O1"] - O2_MARGIN_DB, got
    stream = [e for e in plan if e["reason"] == "residual-stream"]
    # the position embedding's add (the first norm reads it) and the two residual adds of every block but
    # the last block's output add, which the pooling (mean, FP32) reads rather than a norm
    assert len(stream) == 2 * len(model.blocks), stream
    assert all(e["dtype"] == "float32" and e["rule"] == "structure" and e["op"] == "add.Tensor" for e in stream)
    other_adds = [e for e in plan if e["op"] == "add.Tensor" and e["reason"] != "residual-stream"]
    assert other_adds and all(e["dtype"] == "bfloat16" for e in other_adds)  # the rotary adds stay low
    # a user's pin beats the rule; O1 has the same rule (here its stream follows the FP32 embedding add anyway;
    # tests/test_zoo_o1.py has a model where a low projection restarts it)
    pinned = amplite.convert(program, inputs, precision="bf16", level="O2", verify=False, force_low=["op:add"])
    assert {e["dtype"] for e in pinned.report.data["plan"] if e["op"] == "add.Tensor"} == {"bfloat16"}
    assert {e["node"] for e in plans["O1"] if e["reason"] == "residual-stream"} == {e["node"] for e in stream}


@pytest.mark.parametrize("max_trials", [None, 3])
def test_the_reported_trial_bound_bounds_every_trial_prune_included(max_trials: int | None) -> None:
    torch.manual_seed(0)
    model, inputs = Cancellation().eval(), ((torch.randn(16, 32),), {})
    result = amplite.convert(model, inputs, level="O1", tolerance=parse_tolerance(["sqnr>=40"]),
                             fallback_search=True, max_trials=max_trials)  # fmt: skip
    budget = result.report.data["budget"]
    kinds = [s["kind"] for s in budget["steps"][1:]]
    assert budget["trials"] == len(kinds) <= budget["trial_bound"], budget
    assert budget["search"]["trials"] == sum(k != "prune" for k in kinds)
    if max_trials is None:
        assert "prune" in kinds  # the case where the old bound (search only) was not the bound of `trials`
        n = budget["candidates"]
        assert budget["search"]["bound"] == 2 * math.ceil(math.log2(max(n, 2))) + 10
        assert budget["trial_bound"] == budget["search"]["bound"] + budget["prune"]["bound"]
    else:
        assert budget["trial_bound"] == max_trials
