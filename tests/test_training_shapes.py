"""Any shape: a real DataLoader with three sequence lengths and a short last batch trains transformers GPT-2
and BERT through amplite with the losses torch.autocast gets on the same data.

Two cases run by default (GPT-2 bf16 O2 with the lengths discovered, BERT fp16 O1 with the length declared
in ``dynamic_dims``); the rest of the bf16/fp16 x O1/O2 matrix is marked slow (each case traces tiny
transformers models, ~10 s apiece on two shared CPU cores).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import amplite

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

LENGTHS = [12] * 4 + [16] * 4 + [20] * 3  # batch_size 4: 4x12, 4x16, then a short 3x20


class _Ragged(Dataset):
    def __init__(self, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


CASES = [
    pytest.param("gpt2", "bf16", "O2", False, id="gpt2-bf16-O2-discovered"),
    pytest.param("bert", "fp16", "O1", True, id="bert-fp16-O1-declared"),
    *[
        pytest.param(k, p, lv, False, marks=pytest.mark.slow, id=f"{k}-{p}-{lv}")
        for k, p, lv in [("gpt2", "bf16", "O1"), ("gpt2", "fp16", "O1"), ("gpt2", "fp16", "O2"),
                         ("bert", "bf16", "O1"), ("bert", "bf16", "O2"), ("bert", "fp16", "O2")]
    ],
]  # fmt: skip


@pytest.mark.parametrize(("kind", "precision", "level", "declared"), CASES)
def test_dataloader_with_three_lengths_and_a_short_last_batch_matches_autocast(kind, precision, level, declared):
    model = _model(kind)
    ref = copy.deepcopy(model)
    loader = DataLoader(_Ragged(64), batch_size=4, shuffle=False)
    first = next(iter(loader))
    opt_kw = {"lr": 2e-3}
    dims = {"input_ids": [1], "attention_mask": [1], "labels": [1]} if declared else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net, opt = amplite.prepare_training(model, torch.optim.AdamW(model.parameters(), **opt_kw), ((), first),
                                            precision=precision, level=level, dynamic_dims=dims)  # fmt: skip
    if kind == "gpt2":  # its config says use_cache=True: traced without a KV cache, and it says so
        assert any("use_cache=False" in str(w.message) for w in caught)
        assert model.config.use_cache is True
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kw)
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    ours, theirs, shapes = [], [], []
    for _epoch in range(2):
        for batch in loader:
            shapes.append(tuple(batch["input_ids"].shape))
            loss = net(**batch).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            ours.append(loss.item())
            with torch.autocast("cpu", dtype=low):
                ref_loss = ref(**batch).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            theirs.append(ref_loss.item())
    assert shapes[:3] == [(4, 12), (4, 16), (3, 20)]
    assert net.graphs == 1 if declared else net.graphs == 2  # one re-trace made the length dynamic
    tol = 2e-2 if precision == "bf16" else 5e-3
    assert ours == pytest.approx(theirs, rel=tol)  # step by step, within the low dtype's rounding
    assert ours[-1] < ours[0]
    net.eval()  # evaluation without labels: another keyword set, one more graph, the same weights
    with torch.no_grad():
        batch = {"input_ids": first["input_ids"][:1], "attention_mask": first["attention_mask"][:1]}
        logits = net(**batch).logits
        ref.eval()
        with torch.autocast("cpu", dtype=low):
            expected = ref(**batch).logits.float()
    assert logits.shape == expected.shape and (logits.float() - expected).abs().max() < 0.1
