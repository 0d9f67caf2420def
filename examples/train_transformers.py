"""A tiny GPT-2 trained with transformers' Trainer, through amplite (bf16, O2).

The only change from the Trainer's own mixed precision is the class; ``TrainingArguments(bf16=True)`` stays:

    Trainer(model, args, train_dataset=...)                            # autocast (bf16=True)
    AmpliteTrainer(model, args, train_dataset=..., amplite_level="O2")  # amplite: plan, FP32 masters, bf16 copies

Run:     python examples/train_transformers.py --out runs/hf                 (amplite, 50 steps)
         python examples/train_transformers.py --out runs/hf-auto --mode bf16  (the Trainer's autocast)
Resume:  python examples/train_transformers.py --out runs/hf --resume runs/hf/checkpoint-25
Shorter: python examples/train_transformers.py --out runs/hf-short --steps 20  (evaluates and checkpoints at
         the halfway step and at the end: checkpoint-10, checkpoint-20)
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download

import torch
import transformers

from amplite.integrations.transformers import AmpliteTrainer

VOCAB, SEQ = 128, 16


class TokenData(torch.utils.data.Dataset):
    """Learnable synthetic text (a fixed permutation followed 90 % of the time), fixed-length examples."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
        self.ids = torch.empty(n, SEQ, dtype=torch.long)
        self.ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for t in range(1, SEQ):
            jump = torch.rand(n, generator=g) < 0.1
            self.ids[:, t] = torch.where(jump, torch.randint(0, VOCAB, (n,), generator=g), perm[self.ids[:, t - 1]])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts the labels itself


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config (seeded: every run starts from the same weights)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, use_cache=False,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout off: a resumed run repeats exactly
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)  # stock: the Trainer passes num_items_in_batch, amplite traces it


def run(out: str, mode: str = "amplite", steps: int = 50, resume: str | None = None) -> transformers.Trainer:
    """Train ``steps`` optimizer steps (or resume) and save the model to ``out``/final; returns the Trainer.

    Evaluates and saves a checkpoint every ``steps // 2`` steps (``checkpoint-25`` of the default 50).
    """
    half = max(1, steps // 2)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=5, max_grad_norm=1.0,
        eval_strategy="steps", eval_steps=half, per_device_eval_batch_size=4, save_steps=half, logging_steps=1,
        bf16=mode != "fp32", use_cpu=True, seed=0, report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    kwargs: dict[str, Any] = {"train_dataset": TokenData(400, seed=0), "eval_dataset": TokenData(16, seed=1)}
    if mode == "amplite":
        trainer = AmpliteTrainer(tiny_gpt2(), args, amplite_level="O2", **kwargs)
    else:
        trainer = transformers.Trainer(tiny_gpt2(), args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))  # the FP32 model: from_pretrained loads it
    return trainer


def losses(trainer: transformers.Trainer) -> list[float]:
    """The training loss logged at every optimizer step."""
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/hf")
    ap.add_argument("--mode", default="amplite", choices=["amplite", "bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps (evaluated and saved at half and end)")
    ap.add_argument("--resume", default=None, help="a Trainer checkpoint folder (checkpoint-N)")
    args = ap.parse_args()
    trainer = run(args.out, args.mode, args.steps, args.resume)
    seen = losses(trainer)
    print(f"{len(seen)} steps logged, first loss {seen[0]:.4f}, last loss {seen[-1]:.4f}")
    print(f"eval loss {trainer.evaluate()['eval_loss']:.4f}; FP32 model saved to {os.path.join(args.out, 'final')}")


if __name__ == "__main__":
    main()
