"""A tiny GPT-2 trained with PyTorch Lightning, through amplite's precision plugin (bf16, O2).

The only change from Lightning's own mixed precision is the Trainer argument:

    Trainer(precision="bf16-mixed")                            # autocast
    Trainer(plugins=[AmplitePrecision("bf16", level="O2")])    # amplite: plan, FP32 masters, bf16 weight copies

Run:     python examples/train_lightning.py --out runs/lightning                 (amplite, 5 epochs)
         python examples/train_lightning.py --out runs/autocast --mode bf16-mixed  (Lightning's autocast)
Resume:  python examples/train_lightning.py --out runs/lightning --epochs 8 --resume runs/lightning/last.ckpt
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, TensorDataset

from amplite.integrations.lightning import AmplitePrecision

VOCAB, SEQ, BATCH, BATCHES = 128, 16, 4, 10  # 10 optimizer steps per epoch


def token_data(n: int, seed: int) -> TensorDataset:
    """Learnable synthetic text: each token follows a fixed permutation of the previous one 90 % of the time."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    ids = torch.empty(n, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        jump = torch.rand(n, generator=g) < 0.1
        ids[:, t] = torch.where(jump, torch.randint(0, VOCAB, (n,), generator=g), perm[ids[:, t - 1]])
    return TensorDataset(ids)


class TinyGPT(pl.LightningModule):
    """A 2-layer GPT-2 (transformers' GPT2LMHeadModel from a config) as a causal language model."""

    def __init__(self, lr: float = 3e-3, steps: int = 50) -> None:
        super().__init__()
        self.save_hyperparameters()
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, use_cache=False,
            attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout off: a resumed run repeats exactly
        )  # fmt: skip
        self.gpt = transformers.GPT2LMHeadModel(cfg)
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=ids).logits

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids)  # through amplite's converted graph under AmplitePrecision
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch[0]))

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=self.hparams.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(out: str, mode: str = "amplite", epochs: int = 5, resume: str | None = None) -> TinyGPT:
    """Train (or resume) and return the module; checkpoints go to ``out`` (one per epoch and last.ckpt)."""
    pl.seed_everything(0, verbose=False)
    model = TinyGPT(steps=50)
    train = DataLoader(token_data(BATCH * BATCHES, seed=0), batch_size=BATCH)  # fixed-length batches
    val = DataLoader(token_data(2 * BATCH, seed=1), batch_size=BATCH)
    precision: dict[str, Any] = (
        {"plugins": [AmplitePrecision("bf16", level="O2")]} if mode == "amplite" else {"precision": mode}
    )
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=1.0, callbacks=[ckpt],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1, **precision,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's hints about workers and logging on a toy run
        trainer.fit(model, train, val, ckpt_path=resume)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/lightning")
    ap.add_argument("--mode", default="amplite", choices=["amplite", "bf16-mixed", "32-true"])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--resume", default=None, help="a Lightning checkpoint to resume from")
    args = ap.parse_args()
    model = run(args.out, args.mode, args.epochs, args.resume)
    print(f"{len(model.losses)} steps, first loss {model.losses[0]:.4f}, last loss {model.losses[-1]:.4f}")
    print(f"checkpoints in {Path(args.out).resolve()}")


if __name__ == "__main__":
    main()
