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

    python bench/bench_fp8_lm.py [--steps 120] [--threads 1]
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


def markov(seed: int = 0) -> torch.Tensor:
    """A seeded sparse transition matrix: each token goes to 4 tokens (probabilities 0.4/0.3/0.2/0.1), so the
    top-1 margins are small enough for greedy agreement to notice a perturbed model."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(VOCAB, VOCAB)
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1])
    successors = len(weights)
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
        if step % 50 == 0:
            print(f"step {step}: loss {float(loss.detach()):.3f}", file=sys.stderr, flush=True)
    ent = -(probs * probs.clamp_min(1e-12).log()).sum(1).mean()
    return model.eval(), float(loss.detach()), float(ent)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """FP32 logits of ``model`` on ``ids`` (one prefill, no cache)."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def fidelity(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Logit SQNR (dB) and mean KL(FP32 || converted) per token (nats) over the evaluation tokens."""
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (got - ref).pow(2).sum().clamp_min(1e-30))
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    return float(sqnr), float(kl.sum(-1).mean())


def size(path: Path) -> int:
    """Bytes of the ``*.safetensors`` files of a checkpoint directory."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


#: Published shapes (config.json of meta-llama/Meta-Llama-3-8B and Llama-3.2-1B) for the layout's size arithmetic.
LLAMA_SHAPES = {
    "Llama-3-8B": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Llama-3.2-1B": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
}  # fmt: skip


def layout_bytes(shapes: dict[str, object], static: bool = True) -> tuple[int, int]:
    """``(fp8, bf16)`` bytes of the tensors a checkpoint of these shapes holds, built on the meta device (nothing
    allocated): in the FP8 layout every ``nn.Linear`` of a decoder block is 1 byte per weight plus its FP32
    ``weight_scale`` (and ``input_scale`` when static), every other tensor bf16; a tied head is stored once."""
    import transformers

    config = transformers.LlamaConfig(**shapes)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(config)
    fp8 = bf16 = 0
    seen: set[int] = set()
    for path, mod in lm.named_modules():
        for name, t in mod.named_parameters(recurse=False):
            if id(t) in seen:
                continue
            seen.add(id(t))
            bf16 += 2 * t.numel()
            block_linear = isinstance(mod, torch.nn.Linear) and ".layers." in f".{path}" and name == "weight"
            fp8 += t.numel() + 4 * (2 if static else 1) if block_linear else 2 * t.numel()
    return fp8, bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="training steps (batch 16 x 64 tokens)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import amplite
    from amplite.checkpoint.fp8_model import load_fp8_model
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
        ref = logits(model, eval_ids)
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
            conv = load_fp8_model(path, acts) if path != bf16 else \
                transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # type: ignore[arg-type]  # fmt: skip
            sqnr, kl = fidelity(ref, logits(conv, eval_ids))
            del conv
            rows.append((label, m.token_agreement, m.ppl_fp32, m.ppl_converted, m.ppl_delta, sqnr, kl, size(path),
                         m.passed))  # fmt: skip
        fp32_bytes, bf16_bytes = size(src), size(bf16)
        shutil.rmtree(src, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"trained: tiny Llama (4 layers, hidden 128, vocab {VOCAB}), {args.steps} steps in {trained_s:.0f} s, final "
          f"loss {loss:.3f} nats (chain entropy {entropy:.3f}); FP32 checkpoint {fp32_bytes / 2**20:.2f} MiB")
    print(f"eval: {prompts.shape[0]} held-out prompts x 32 teacher-forced greedy steps; perplexity on "
          f"{eval_ids.numel()} held-out tokens; targets: agreement >= 0.97, ppl delta <= 2 %, size <= 0.55x bf16")
    print("| checkpoint | token agreement | ppl FP32 | ppl converted | ppl delta | logit SQNR (dB) | KL (nats/token) "
          "| size (MiB) | size / bf16 | size / FP32 | criteria |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, agree, p32, pconv, delta, sqnr, kl, nbytes, ok in rows:
        print(f"| {label} | {agree:.4f} | {p32:.4f} | {pconv:.4f} | {delta:.3%} | {sqnr:.1f} | {kl:.2e} | "
              f"{nbytes / 2**20:.3f} | {nbytes / bf16_bytes:.3f} | {nbytes / fp32_bytes:.3f} | "
              f"{'pass' if ok else 'FAIL'} |")
    for label, shapes in LLAMA_SHAPES.items():
        f8, b16 = layout_bytes(shapes)
        print(f"{label} shapes (meta device, tensors of this layout counted, not written): fp8 static {f8 / 2**30:.2f} "
              f"GiB, bf16 {b16 / 2**30:.2f} GiB, ratio {f8 / b16:.3f}x (target <= 0.55: "
              f"{'met' if f8 / b16 <= 0.55 else 'NOT met'})")  # fmt: skip
    by = {r[0].split(" (")[0]: r for r in rows}
    base = by["vLLM on-the-fly baseline"]
    for name in ("fp8 static", "fp8 dynamic"):
        r = by[name]
        ratio = r[7] / bf16_bytes
        print(f"{name} vs the on-the-fly baseline: ppl delta {r[4]:.3%} vs {base[4]:.3%}, KL {r[6]:.2e} vs "
              f"{base[6]:.2e} ({r[6] / base[6]:.2f}x), logit SQNR {r[5] - base[5]:+.1f} dB; size {ratio:.3f}x "
              f"bf16 (target <= 0.55: {'met' if ratio <= 0.55 else 'NOT met'})")


if __name__ == "__main__":
    main()
