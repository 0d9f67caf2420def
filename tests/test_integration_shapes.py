"""The integrations on batches of changing length, as real data loaders give them (issue 32 on issue 28).

Lightning's plugin and ``AmpliteTrainer`` are fed a loader whose batches have three sequence lengths and a
short last batch; each run is compared step by step with the framework's own bf16 autocast on the same data
and seeds, and the net must have handled the new sizes by re-tracing with dynamic dimensions (bounded cache),
not by failing or by running a graph specialised to another length.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from amplite.integrations.lightning import AmplitePrecision  # noqa: E402
from amplite.integrations.transformers import AmpliteTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (16, 11, 7)  # chosen per batch from its content, so both runs of a pair see the same batches


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lit, hf = _load("train_lightning"), _load("train_transformers")


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _length(first_token: int) -> int:
    return LENGTHS[first_token % len(LENGTHS)]


def _truncate(batch: list[tuple[torch.Tensor]]) -> list[torch.Tensor]:
    ids = torch.stack([row[0] for row in batch])
    return [ids[:, : _length(int(ids[0, 0]))]]


def _lightning(plugin_or_precision: dict) -> tuple[pl.LightningModule, set[tuple[int, int]]]:
    pl.seed_everything(0, verbose=False)
    model = lit.TinyGPT(steps=11)
    shapes: set[tuple[int, int]] = set()
    # 42 sequences in batches of 4: ten full batches and a last batch of 2
    data = lit.token_data(42, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=lit.BATCH, collate_fn=_truncate)
    for batch in loader:
        shapes.add(tuple(batch[0].shape))
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=1.0,
                         num_sanity_val_steps=0, **plugin_or_precision)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    return model, shapes


def test_lightning_plugin_trains_variable_lengths_like_bf16_mixed():
    plugin = AmplitePrecision("bf16", level="O2")
    ours, shapes = _lightning({"plugins": [plugin]})
    auto, _ = _lightning({"precision": "bf16-mixed"})
    assert len({s[1] for s in shapes}) == 3 and min(s[0] for s in shapes) == 2  # 3 lengths, short last batch
    assert len(ours.losses) == len(auto.losses) == 11
    assert _rel(ours.losses, auto.losses) < 0.01  # every step within 1 % of Lightning's own bf16-mixed
    info = plugin.net.info
    assert 2 <= info["graphs"] <= 4 and info["retraces"]  # new sizes re-traced with dynamic dims, bounded
    # the sequence length (dim 1) became dynamic, not only the batch (the short last batch alone makes dim 0)
    assert any(d.endswith(":1") for r in info["retraces"] for d in r["dynamic"]), info["retraces"]


class _Collate:
    """Truncate each Trainer batch to a length chosen by its content (labels follow the ids)."""

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([r["input_ids"] for r in rows])
        ids = ids[:, : _length(int(ids[0, 0]))]
        return {"input_ids": ids, "labels": ids.clone()}


def _hf(tmp_path: Path, mode: str) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / mode), max_steps=11, per_device_train_batch_size=4, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=1, bf16=True, use_cpu=True, seed=0, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    # 42 examples, 4 per batch, max_steps 11: the 11th batch is the short one (2 examples)
    kw = {"train_dataset": hf.TokenData(42, seed=0), "data_collator": _Collate()}
    trainer = (AmpliteTrainer(hf.tiny_gpt2(), args, amplite_level="O2", **kw) if mode == "amplite"
               else transformers.Trainer(hf.tiny_gpt2(), args, **kw))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def test_transformers_trainer_trains_variable_lengths_like_bf16_true(tmp_path):
    ours, auto = _hf(tmp_path, "amplite"), _hf(tmp_path, "bf16")
    a, b = hf.losses(ours), hf.losses(auto)
    assert len(a) == 11 and _rel(a, b) < 0.01
    info = ours.amplite_net.info
    assert 2 <= info["graphs"] <= 4
    assert any(d.endswith(":1") for r in info["retraces"] for d in r["dynamic"]), info["retraces"]  # the length
