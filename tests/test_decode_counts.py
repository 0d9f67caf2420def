"""Decode at batch 1: what one decode step of the converted LLM step program executes, against the all-bf16
model run through the same step (issue 41; bench/decode_count.py records the full table).

The counts are the device's work, not its speed, so they are taken on the CPU: on a GPU every compute op is
a kernel launch, and at batch 1 the step is launch-bound.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import decode_count as dc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def programs():
    from amplite.llm import convert_llm
    from amplite.llm.step import cache_shape

    model = dc.tiny_gpt2()
    made = dc.steps(model, ("fp32", "all-bf16"))
    o2 = convert_llm(model, precision="bf16", level="O2", verify=False).llm
    return model, cache_shape(model), made, o2


@pytest.mark.parametrize("batch", [1, 32])
def test_o2_decode_step_does_what_the_all_bf16_model_does(programs, batch) -> None:
    """Per decode step, amplite O2 (as generate() runs it) against the all-bf16 model in the same step:

    * casts: at most 2 per norm more (the policy keeps LayerNorm's statistics FP32: one cast in, one out;
      under torch.compile they fuse into the norm's kernel, bench/RESULTS.md), none of a weight;
    * compute ops: those casts, nothing else (the 4 ``lift_fresh_copy`` of ``torch.tensor([])`` constants
      that ``DynamicLayer``'s lazy initialisation put in the exported step are gone with the cache seeding);
    * the same KV-cache copies, no host sync, and no per-call input check (the runner's inputs are its own).
    """
    _, shape, made, o2 = programs
    step, dtype = made["all-bf16"]
    bf16 = dc.count_decode(step, shape, dtype, batch=batch)
    runner = o2.runner()
    amp = dc.count_decode(runner.step, shape, o2.cache_dtype, batch=batch)
    assert o2.cache_dtype == torch.bfloat16  # the cache crosses the boundary in bf16: no cache casts
    norms = bf16["norms"]
    assert norms == amp["norms"] == 5  # 2 layers x 2 + the final one
    assert amp["casts"] <= bf16["casts"] + 2 * norms, (amp, bf16)
    assert amp["kernel_ops"] <= bf16["kernel_ops"] + 2 * norms, (amp, bf16)
    assert amp["cache_copies"] == bf16["cache_copies"] and amp["cache_copy_kib"] == bf16["cache_copy_kib"]
    assert amp["syncs"] == bf16["syncs"] == 0
    assert amp["input_checks"] == 0


@pytest.mark.parametrize("variant", ["fp32", "all-bf16", "amplite-O2"])
def test_decode_step_copies_the_kv_cache_only_where_attention_needs_it(programs, variant) -> None:
    """Per decode step as generate() runs it, one copy of each layer's keys and of its values: the ``cat``
    that appends the new token for attention (the functional step's own). The past cache is not copied when
    the step takes it in (``DynamicCache(ddp_cache_data=...)`` did: ``cat`` onto empty), nor when it leaves
    (the step returns only the new token's keys/values, which the runner writes into its cache)."""
    _, shape, made, o2 = programs
    step, dtype = (o2.runner().step, o2.cache_dtype) if variant == "amplite-O2" else made[variant]
    past, size = 16, (2 if dtype == torch.bfloat16 else 4)
    got = dc.count_decode(step, shape, dtype, batch=1, past=past)
    layer_bytes = shape.kv_heads * (past + 2) * shape.head_dim * size  # one layer's keys after the step
    assert got["cache_copies"] == 2 * shape.layers, got
    assert got["cache_copy_kib"] * 1024 <= 2 * shape.layers * layer_bytes, (got, layer_bytes)


def test_module_keeps_the_input_check_the_runner_skips(programs) -> None:
    """module() (what users call directly) still checks its inputs; the runner's module does not."""
    _, shape, _, o2 = programs
    assert dc.count_decode(o2.module(), shape, o2.cache_dtype)["input_checks"] == 1
    assert dc.count_decode(o2.runner().step, shape, o2.cache_dtype)["input_checks"] == 0
    with pytest.raises(Exception):  # noqa: B017  (torch's own error type for a wrong input count)
        o2.module()(torch.zeros(1, 1, dtype=torch.long))


def test_runner_generates_the_same_tokens_as_the_checked_module(programs) -> None:
    """Skipping the check changes no number: greedy tokens equal those of the checked module."""
    from amplite.llm.generate import Runner, greedy

    _, shape, _, o2 = programs
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    checked = greedy(Runner(o2.module(), shape, o2.cache_dtype), ids, 5)
    assert torch.equal(o2.generate(ids, 5), checked)


def test_compiled_decode_step_has_no_graph_break_or_recompile(programs) -> None:
    """torch.compile captures O2's decode step as one graph that serves every cache length (dynamo counters;
    the eager backend keeps it fast: capture is what CUDA graphs / inductor need, not the codegen)."""
    from torch._dynamo.utils import counters

    o2 = programs[3]
    torch._dynamo.reset()
    counters.clear()
    runner = o2.runner()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    logits, keys, values = runner.prefill(ids, torch.ones(1, 8, dtype=torch.long), 12)
    runner.step = torch.compile(runner.step, backend="eager")
    with torch.no_grad():
        for i in range(4):  # four decode steps, cache length 8 -> 11 in, views of the runner's cache
            token = logits[:, -1].argmax(-1)
            mask = torch.ones(1, 9 + i, dtype=torch.long)
            for t, dim in ((mask, 1), (keys, 3), (values, 3)):
                torch._dynamo.mark_dynamic(t, dim)  # the cache grows by one per step: one dynamic graph
            logits, keys, values = runner.decode(token, mask, keys, values)
    assert keys.shape[3] == 12
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    torch._dynamo.reset()


def test_program_converted_elsewhere_and_moved_runs_the_same(programs) -> None:
    """bench/gpu_decode.py's fallback (convert on the CPU, move_to_device_pass) gives the same step."""
    from bench import gpu_decode

    model, shape, _, o2 = programs
    step, dtype = gpu_decode._converted_on_cpu(model, "O2", torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    empty = shape.empty(1, dtype, "cpu")
    with torch.no_grad():
        got = step(ids, torch.ones(1, 5, dtype=torch.long), empty, empty)
        want = o2.runner().step(ids, torch.ones(1, 5, dtype=torch.long), empty, empty)
    assert dtype == o2.cache_dtype and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
