"""The Accelerate recipe: Accelerate for devices and data, amplite for the precision (a tiny GPT-2, bf16 O2).

    accelerator = Accelerator(mixed_precision="bf16")  # autocast
    accelerator = Accelerator()                         # + amplite.prepare_training: plan, FP32 masters, bf16 copies

amplite takes the place of Accelerate's mixed precision, not of Accelerate: keep ``mixed_precision="no"``
(autocast over amplite's graph would recast it), call ``opt.backward(loss)`` instead of
``accelerator.backward(loss)`` (amplite scales fp16 losses and sums the low copies' gradients into the FP32
masters), one process (see docs/training.md).

Run: python examples/train_accelerate.py [--mode amplite|bf16] [--steps 30]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from accelerate import Accelerator
from train_transformers import TokenData, tiny_gpt2  # the same tiny GPT-2 and synthetic data

import amplite


def run(mode: str = "amplite", steps: int = 30) -> list[float]:
    """Train ``steps`` steps; the loss of every step."""
    model = tiny_gpt2()  # seeded
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    loader = torch.utils.data.DataLoader(TokenData(4 * steps, seed=0), batch_size=4)
    accelerator = Accelerator(cpu=True, mixed_precision="no" if mode == "amplite" else mode)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    if mode == "amplite":
        first = next(iter(loader))
        net, opt = amplite.prepare_training(accelerator.unwrap_model(model), optimizer, ((), first),
                                            precision="bf16", level="O2")  # fmt: skip
        for batch in loader:
            loss = net(**batch).loss
            opt.backward(loss)  # instead of accelerator.backward(loss)
            opt.unscale_()  # true gradients in the FP32 masters before clipping
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scheduler.step()
            opt.zero_grad()
            losses.append(loss.item())
    else:
        for batch in loader:
            loss = model(**batch).loss  # accelerator.prepare wrapped forward in autocast
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="amplite", choices=["amplite", "bf16"])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    losses = run(args.mode, args.steps)
    print(f"{len(losses)} steps, first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
