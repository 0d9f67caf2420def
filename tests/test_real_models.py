"""Real architectures from `transformers` (in the dev extra, so `make test` runs them): tiny configs, random
weights, no download."""

from __future__ import annotations

import os

import torch
import transformers

import amplite

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, never a download


class DecodeStep(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: object) -> tuple:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values


def test_gpt2_with_kv_cache_converts_and_keeps_tied_weights_tied() -> None:
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
    inputs = {"input_ids": ids[:, 8:], "attention_mask": torch.ones(1, 9, dtype=torch.long), "cache": cache}
    # The cache's tensors are lifted constants: re-export used to fail with "lifted_tensor_0 is not a buffer".
    result = amplite.convert(DecodeStep(model).eval(), inputs, level="O2")
    failing = [o for o in result.report.outputs if not o["passed"]]
    assert not failing, failing
    assert result.report.data["weights"]["ratio"] <= 0.51  # wte and lm_head stay one (fp16) tensor
