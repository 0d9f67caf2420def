"""Mixed-precision training with amplite: a small transformer classifier on synthetic data.

Run on one process:   python examples/train_amplite.py --precision bf16 --level O2
Run on two (DDP):     torchrun --nproc_per_node 2 examples/train_amplite.py --precision bf16 --level O2
Resume a checkpoint:  python examples/train_amplite.py --resume ckpt.pt
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import amplite


class Classifier(nn.Module):
    """Embedding, two encoder layers with dropout, mean pooling, a linear head."""

    def __init__(self, vocab: int = 500, d: int = 64, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def batches(n: int, rank: int = 0, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic, learnable data: the class is the first token modulo 5 (each rank gets its own)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 500, (batch, 16), generator=g)
        out.append((ids, ids[:, 0] % 5))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--level", default="O2", choices=["O1", "O2"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--accumulate", type=int, default=2, help="backwards per optimizer step")
    ap.add_argument("--save", default="ckpt.pt")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = Classifier()  # FP32: its parameters are the master weights
    if args.resume:
        state = torch.load(args.resume)
        model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, args.steps)  # schedule the user's optimizer
    data = batches(args.steps * args.accumulate, rank)

    net, opt = amplite.prepare_training(model, optimizer, data[0][0], precision=args.precision, level=args.level)
    if args.resume:
        opt.load_state_dict(state["opt"])  # optimizer + loss-scaler state; refreshes the low copies
    if distributed:
        net = torch.nn.parallel.DistributedDataParallel(net)

    net.train()
    for step in range(args.steps):
        for ids, y in data[step * args.accumulate : (step + 1) * args.accumulate]:
            loss = F.cross_entropy(net(ids), y) / args.accumulate
            opt.backward(loss)  # fp16: scaled backward; bf16: plain backward
        opt.unscale_()  # true gradients in the FP32 masters, for clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # skips the step on inf/NaN (fp16) and lowers the loss scale
        opt.zero_grad()
        scheduler.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item() * args.accumulate:.4f}  loss scale {opt.loss_scale:g}")

    net.eval()  # dropout off; the eval graph
    with torch.no_grad():
        ids, y = batches(1, rank=99)[0]
        accuracy = (net(ids).argmax(-1) == y).float().mean().item()
    if rank == 0:
        print(f"eval accuracy {accuracy:.2f}")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)  # FP32 checkpoint
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
