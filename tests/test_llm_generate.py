"""Converted LLMs that generate (amplite.llm): one step program with a KV cache, greedy generation, save and
load in a fresh process, and verification by token agreement and perplexity. Tiny configs, no downloads."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import amplite.llm as llm  # noqa: E402
from amplite.errors import AmpliteError  # noqa: E402
from amplite.llm.convert import DYNAMIC_DIMS  # noqa: E402
from amplite.llm.generate import Runner, greedy  # noqa: E402
from amplite.llm.step import LMStep, amplite_attention  # noqa: E402
from amplite.verify.criteria import parse_criterion, parse_tolerance  # noqa: E402
from tests import fresh  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
#: Thresholds these tests hold the converted Llama to (teacher-forced greedy agreement with FP32).
BF16_AGREEMENT, FP16_AGREEMENT = 0.95, 0.99
#: Teacher-forced agreement steps per prompt in the fixtures (generation itself is 32 tokens; the FP32
#: reference decode is the slow part of verification, so the agreement is measured on 4 x 16 positions).
AGREEMENT_STEPS = 16


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of length 7 and two of length 4, left-padded into one batch."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[2:, :3] = 0
    return ids, mask


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return _llama()


@pytest.fixture(scope="module")
def bf16(llama: torch.nn.Module) -> llm.LLMResult:
    return llm.convert_llm(llama, precision="bf16", level="O2", steps=AGREEMENT_STEPS)


@pytest.fixture(scope="module")
def fp16(llama: torch.nn.Module) -> llm.LLMResult:
    return llm.convert_llm(llama, precision="fp16", level="O1", steps=AGREEMENT_STEPS)


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """The plainest FP32 greedy decoding: transformers' forward on the whole unpadded sequence, no cache."""
    rows = []
    with torch.no_grad():
        for row, m in zip(ids, mask, strict=True):
            seq = row[m.bool()][None]
            for _ in range(n):
                seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
            rows.append(seq[0, -n:])
    return torch.stack(rows)


def test_fp32_step_generates_what_transformers_generates(llama: torch.nn.Module) -> None:
    """The step module (left padding, cache in/out) decodes as transformers' forward (no cache, unpadded)."""
    ids, mask = _prompts()
    with amplite_attention(llama):
        step = LMStep(llama)
        ours = greedy(Runner(step, step.shape, torch.float32), ids, 6, mask)[:, ids.shape[1] :]
    assert torch.equal(ours, _hf_greedy(llama, ids, mask, 6))


@pytest.mark.parametrize("which, threshold, dtype", [("bf16", BF16_AGREEMENT, torch.bfloat16),
                                                     ("fp16", FP16_AGREEMENT, torch.float16)])  # fmt: skip
def test_converted_llama_generates_32_tokens_with_a_low_precision_cache(
    request: pytest.FixtureRequest, llama: torch.nn.Module, which: str, threshold: float, dtype: torch.dtype
) -> None:
    res: llm.LLMResult = request.getfixturevalue(which)
    section = res.report.data["llm"]
    assert res.passed is True and section["passed"] is True
    assert section["token_agreement"] >= threshold and section["prompts"] * section["steps"] == 4 * AGREEMENT_STEPS
    assert section["prompt_lengths"] == [8, 8, 5, 5] and 0 <= section["ppl_delta"] < 0.01
    assert {c["criterion"].split(">")[0].split("<")[0] for c in section["checks"]} == {"token_agreement", "ppl_delta"}
    # the cache crosses the program in the low dtype, in and out
    past = next(n for n in res.program.graph.nodes if n.op == "placeholder" and n.name == "past_keys")
    assert res.llm.cache_dtype == dtype and past.meta["val"].dtype == dtype
    ids, mask = _prompts()
    out = res.generate(ids, 32, attention_mask=mask)
    assert out.shape == (4, 7 + 32) and torch.equal(out[:, :7], ids)
    logits, keys, values = res.llm.runner().prefill(out[:, :3], torch.ones(4, 3, dtype=torch.long))
    assert keys.dtype == values.dtype == dtype and keys.shape == (2, 4, 2, 3, 16) and logits.dtype == torch.float32
    if which == "fp16":  # free-running greedy text against transformers' FP32 forward
        agree = float((out[:, 7:] == _hf_greedy(llama, ids, mask, 32)).double().mean())
        assert agree >= 0.9, agree


def test_saved_step_program_generates_identically_in_a_fresh_process(fp16: llm.LLMResult, tmp_path: Path) -> None:
    path = fp16.save(tmp_path / "llama.pt2")
    from amplite.converter.emit import read_conversion

    recorded = read_conversion(path)  # the spec it was converted with, read back whole
    assert recorded is not None and recorded.spec == fp16.conversion.spec
    assert (recorded.spec.path, recorded.spec.precision, recorded.spec.dims()) == ("llm", torch.float16, DYNAMIC_DIMS)
    ids, mask = _prompts()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "prompts.pt")
    expected = fp16.generate(ids, 32, attention_mask=mask)
    code = (
        "import sys, torch, amplite.llm as llm\n"
        f"p = torch.load({str(tmp_path / 'prompts.pt')!r})\n"
        f"prog = llm.load({str(path)!r})\n"
        "out = llm.generate(prog, p['ids'], 32, attention_mask=p['mask'])\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r}); print(prog.cache_dtype, prog.shape)\n"
    )
    run = fresh.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch.float16" in run.stdout and "layers=2" in run.stdout
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_planted_wrong_program_fails_token_agreement(fp16: llm.LLMResult, llama: torch.nn.Module) -> None:
    good = llm.verify_llm(fp16.llm, llama, precision="fp16", tolerance=["token_agreement>=0.99"], steps=8)
    assert good.passed and good.token_agreement >= 0.99
    wrong = copy.deepcopy(fp16.program)
    name = next(k for k in wrong.state_dict if "layers.1.self_attn.o_proj" in k)
    with torch.no_grad():
        wrong.state_dict[name].mul_(4.0)  # the planted defect: one projection's weight scaled
    bad = llm.verify_llm(llm.LLMProgram.from_program(wrong), llama, precision="fp16",
                         tolerance=["token_agreement>=0.99", "ppl_delta<=0.5%"], steps=8)  # fmt: skip
    assert not bad.passed and bad.token_agreement < 0.99
    assert any(c["criterion"] == "token_agreement>=0.99" and not c["passed"] for c in bad.checks)
    assert any(d is not None for d in bad.first_divergence)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_gpt2_and_qwen2_convert_and_generate(arch: str) -> None:
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4,
                                                                     vocab_size=VOCAB, n_positions=128))  # fmt: skip
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128))  # fmt: skip
    model.eval()
    res = llm.convert_llm(model, precision="fp16", level="O2", steps=8, tolerance=["token_agreement>=0.9"])
    assert res.passed is True and res.metrics is not None and res.metrics.token_agreement >= 0.9
    assert res.llm.cache_dtype == torch.float16
    ids, mask = _prompts()
    out = res.generate(ids, 8, attention_mask=mask)
    with amplite_attention(model):
        step = LMStep(model)
        ref = greedy(Runner(step, step.shape, torch.float32), ids, 8, mask)
    assert float((out == ref).double().mean()) >= 0.9


def test_llm_criteria_parse() -> None:
    assert parse_criterion("ppl_delta<=0.5%").threshold == pytest.approx(0.005)
    assert str(parse_criterion("token_agreement>=0.99")) == "token_agreement>=0.99"
    assert parse_tolerance(["token_agreement>=0.99, ppl_delta<=0.5%"]).criteria == (
        "token_agreement>=0.99", "ppl_delta<=0.005")  # fmt: skip
    with pytest.raises(AmpliteError, match="unknown metric"):
        parse_criterion("tokens>=0.99")


def test_bad_inputs_are_one_line_errors(fp16: llm.LLMResult) -> None:
    ids = torch.randint(0, VOCAB, (2, 5))
    right = torch.ones_like(ids)
    right[1, -2:] = 0
    with pytest.raises(AmpliteError, match="right-padded"):
        fp16.generate(ids, 4, attention_mask=right)
    with pytest.raises(AmpliteError, match="not a transformers causal LM"):
        llm.convert_llm(torch.nn.Linear(4, 4).eval())
    with pytest.raises(AmpliteError, match="unknown precision 'fp61'"):  # was converted as fp16 without a word
        llm.convert_llm(torch.nn.Linear(4, 4).eval(), precision="fp61")
    with pytest.raises(AmpliteError, match="not an amplite LLM step program"):
        llm.LLMProgram.from_program(torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),)))
