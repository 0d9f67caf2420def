"""Fidelity and size of FP8 checkpoint directories on a small causal LM trained here (issue 42, part B).

A tiny Llama (transformers config, built by code) is trained for a few minutes on a seeded synthetic token
stream (a sparse Markov chain: each token has a few likely successors, so the trained model's predictions are
peaked, not flat), saved as a sharded FP32 checkpoint directory, then converted with ``amplite convert DIR``:

* ``bf16``: bf16 O2 (the size reference);
* ``fp8 static``: FP8 linears, ``input_scale`` calibrated on held-out stream batches;
* ``fp8 dynamic``: FP8 linears, per-token dynamic activations (vLLM with CUTLASS FP8 kernels);
* ``vLLM on-the-fly baseline``: what ``vllm serve --quantization fp8`` does to the bf16 checkpoint: per-tensor
  weight scales, dynamic per-tensor activations (our FP8 converter applied to the bf16 directory, run with
  per-tensor activation quantization).

Each is measured against the FP32 source by ``amplite.llm.checkpoint.verify_checkpoint`` on held-out stream
prompts (teacher-forced token agreement over 32 greedy steps, perplexity delta on held-out text). FP8 cannot run
on this CPU: the FP8 directories run dequantized in bf16 with each FP8 linear's input quantized to e4m3 with its
scale (``amplite.checkpoint.fp8_model``). Sizes are the bytes of the written ``*.safetensors`` files.

    python bench/bench_fp8_lm.py [--steps 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: this checkout's amplite, not an installed one
    sys.path.insert(0, str(ROOT))

VOCAB, SEQ = 64, 64


def markov(seed: int = 0, successors: int = 3) -> torch.Tensor:
    """A seeded sparse transition matrix: each token goes to ``successors`` tokens (probabilities 0.6/0.3/0.1)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(VOCAB, VOCAB)
    weights = torch.tensor([0.6, 0.3, 0.1])[:successors]
    for t in range(VOCAB):
        probs[t, torch.randperm(VOCAB, generator=gen)[:successors]] = weights / weights.sum()
    return probs


def stream(probs: torch.Tensor, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``[batch, seq]`` token ids sampled from the chain."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, seq, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
    for i in range(1, seq):
        ids[:, i] = torch.multinomial(probs[ids[:, i - 1]], 1, generator=gen).squeeze(1)
    return ids


def train(steps: int, probs: torch.Tensor) -> tuple[torch.nn.Module, float, float]:
    """The trained model, its final training loss and the chain's entropy rate (the loss floor), in nats."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        ids = stream(probs, 16, SEQ, seed=1000 + step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    ent = -(probs * probs.clamp_min(1e-12).log()).sum(1).mean()
    return model.eval(), float(loss.detach()), float(ent)


def size(path: Path) -> int:
    """Bytes of the ``*.safetensors`` files of a checkpoint directory."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (batch 16 x 64 tokens)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import amplite
    from amplite.llm.checkpoint import verify_checkpoint
    from amplite.verify.criteria import parse_criterion

    criteria = [parse_criterion("token_agreement>=0.97"), parse_criterion("ppl_delta<=2%")]
    probs = markov()
    start = time.perf_counter()
    model, loss, entropy = train(args.steps, probs)
    trained_s = time.perf_counter() - start
    prompts = stream(probs, 8, 16, seed=7)  # held-out: seeds the training never used
    eval_ids = stream(probs, 8, SEQ, seed=8)
    calib = [stream(probs, 4, SEQ, seed=9 + i) for i in range(4)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="amplite-fp8-bench.") as tmp:
        src = Path(tmp) / "fp32"
        model.save_pretrained(src, max_shard_size="1MB", safe_serialization=True)
        del model
        bf16 = Path(tmp) / "bf16"
        amplite.convert(src, precision="bf16").save(bf16, verify=False)
        static = Path(tmp) / "fp8-static"
        amplite.convert(src, precision="fp8", calibration=calib).save(static, verify=False)
        dynamic = Path(tmp) / "fp8-dynamic"
        amplite.convert(src, precision="fp8").save(dynamic, verify=False)
        base = Path(tmp) / "fp8-onthefly"
        amplite.convert(bf16, precision="fp8").save(base, verify=False)
        runs = [("bf16 O2", bf16, "stored"), ("fp8 static (calibrated input_scale)", static, "stored"),
                ("fp8 dynamic (per-token activations)", dynamic, "stored"),
                ("vLLM on-the-fly baseline (per-tensor dynamic)", base, "per-tensor")]  # fmt: skip
        for label, path, acts in runs:
            m = verify_checkpoint(src, path, criteria=criteria, prompts=prompts, eval_ids=eval_ids,
                                  fp8_activations=acts)  # type: ignore[arg-type]  # fmt: skip
            rows.append((label, m.token_agreement, m.ppl_fp32, m.ppl_converted, m.ppl_delta, size(path),
                         m.passed))  # fmt: skip
        fp32_bytes, bf16_bytes = size(src), size(bf16)
        shutil.rmtree(src, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"trained: tiny Llama (4 layers, hidden 128, vocab {VOCAB}), {args.steps} steps in {trained_s:.0f} s, final "
          f"loss {loss:.3f} nats (chain entropy {entropy:.3f}); FP32 checkpoint {fp32_bytes / 2**20:.2f} MiB")
    print(f"eval: {prompts.shape[0]} held-out prompts x 32 teacher-forced greedy steps; perplexity on "
          f"{eval_ids.numel()} held-out tokens; targets: agreement >= 0.97, ppl delta <= 2 %, size <= 0.55x bf16")
    print("| checkpoint | token agreement | ppl FP32 | ppl converted | ppl delta | size (MiB) | size / bf16 | "
          "criteria |")
    print("|---|---|---|---|---|---|---|---|")
    for label, agree, p32, pconv, delta, nbytes, ok in rows:
        print(f"| {label} | {agree:.4f} | {p32:.4f} | {pconv:.4f} | {delta:.3%} | {nbytes / 2**20:.3f} | "
              f"{nbytes / bf16_bytes:.3f} | {'pass' if ok else 'FAIL'} |")


if __name__ == "__main__":
    main()
