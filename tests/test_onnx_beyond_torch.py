"""ONNX where torch.onnx alone fails: GPT-2 with a KV cache and T5 (SDPA followed by a view).

Both fail inside torch.onnx's decomposition on the FP32 program too; amplite's pre-ONNX rewrite
(``amplite.onnx.prepare``) removes the cause on a copy, and the file must pass ``onnx.checker`` and run
in ONNX Runtime against the FP32 reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # dev extra: a missing install fails, it does not skip

import amplite
from amplite.onnx.prepare import onnx_ready
from bench.corpus import DecodeStep, Seq2SeqLogits


def _gpt2_kv() -> tuple[torch.nn.Module, tuple]:
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
    inputs = ((), {"input_ids": ids[:, 8:], "attention_mask": torch.ones(1, 9, dtype=torch.long), "cache": cache})
    return DecodeStep(model).eval(), inputs


def _t5() -> tuple[torch.nn.Module, tuple]:
    cfg = transformers.T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    dec = torch.randint(0, 300, (2, 5), generator=gen)
    dec[:, 0] = 0
    inputs = ((), {"input_ids": torch.randint(0, 300, (2, 12), generator=gen),
                   "attention_mask": torch.ones(2, 12, dtype=torch.long), "decoder_input_ids": dec})  # fmt: skip
    return Seq2SeqLogits(model).eval(), inputs


@pytest.mark.parametrize("build", [_gpt2_kv, _t5], ids=["gpt2-kv-cache", "t5"])
def test_exports_passes_the_checker_and_runs_in_onnx_runtime(build, tmp_path: Path) -> None:
    import onnx

    model, inputs = build()
    result = amplite.convert(model, inputs, precision="fp16", level="O2")
    assert result.passed
    before = {n.name: n.target for n in result.program.graph.nodes}
    out = result.save(tmp_path / "m.onnx")
    onnx.checker.check_model(str(out), full_check=True)
    ort = result.report.data["verification_onnx"]
    assert ort["passed"] is True, ort
    assert {n.name: n.target for n in result.program.graph.nodes} == before  # the rewrite was on a copy


def test_the_pre_onnx_rewrite_counts_what_it_changed() -> None:
    model, inputs = _gpt2_kv()
    program = amplite.convert(model, inputs, precision="fp16", level="O2", verify=False).program
    ready, counters = onnx_ready(program)
    assert ready is not program
    assert counters["empty_constants_materialised"] > 0 and counters["cache_constants_preregistered"] == 1
    assert not any(n.target is torch.ops.aten.view.default for n in ready.graph.nodes)
    assert any(n.target is torch.ops.aten.view.default for n in program.graph.nodes)  # the original is untouched
