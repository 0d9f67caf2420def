"""Training step time and memory on the GPU, one model per process (a job of ``bench/gpu_suite.py``, issue 28).

The models are issue 41's GPT-2 124 M (``gpt2-124m``: 12 layers, d 768, 12 heads, vocab 50257, seq 1024,
batch 8) and ResNet-50 (``resnet50``: bottleneck [3, 4, 6, 3], 1000 classes, 224², batch 64, channels_last
model and images), bench/bench_train_big.py's (GPT-2 23.2 M, BERT-MLM 23.5 M, ResNet-34 21.3 M) and, for
``--dry-run``, ``tiny`` (a 2-layer GPT-2) and ``tiny-cnn`` (a 2-stage ResNet, channels_last); the variants are
bench_train_big's: FP32, ``torch.autocast`` bf16, amplite O1/O2 bf16
(``prepare_training``), the whole model in bf16, and ``torch.compile`` of the autocast model and of
amplite's ``net``. Every variant gets its own model (same seed) and the same batches; all are prepared and
warmed up first (compilation happens there), then timed interleaved, round by round, holding the GPU lock.

FP32 runs with TF32 off (matmul and cuDNN), the baseline of issue 41's ratios.

Step time: median over rounds of the median of ``--steps`` steps (forward, loss, backward, AdamW, zero_grad;
``loss.item()`` synchronises). Memory (CUDA): what the variant keeps between steps (weights, every copy of
them, optimizer state: allocated after its warm-up minus before building its model) plus the peak above
that during one timed step (activations, gradients). The batches are not counted.

    python bench/gpu_train.py --model gpt2 [--variants fp32,autocast,...] [--rounds 3 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench import bench_train_big as big  # noqa: E402
from bench.gpu_jobs import emit, gpu_lock, past_deadline  # noqa: E402

VARIANTS = big.VARIANTS
#: Issue 41's models (built here) and the dry run's stand-ins for them; bench_train_big builds the others.
MODELS = ["gpt2-124m", "resnet50", *big.MODELS, "tiny", "tiny-cnn"]
CHANNELS_LAST = ("resnet50", "tiny-cnn")


def _issue41(name: str, n: int) -> tuple[torch.nn.Module, list[Any], Any]:
    """GPT-2 124 M / ResNet-50 (or their tiny stand-ins) in train mode, ``n`` batches, the loss."""
    import torch.nn.functional as F

    from bench.corpus import ImageLogits, _hf

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name in CHANNELS_LAST:
        tiny = name == "tiny-cnn"
        m = _hf("ResNetForImageClassification", "ResNetConfig", embedding_size=8 if tiny else 64,
                depths=[1, 1] if tiny else [3, 4, 6, 3], hidden_sizes=[16, 32] if tiny else [256, 512, 1024, 2048],
                layer_type="bottleneck", hidden_act="relu", num_labels=10 if tiny else 1000)  # fmt: skip
        b, side, classes = (2, 32, 10) if tiny else (64, 224, 1000)
        batches = [(torch.randn(b, 3, side, side, generator=g).contiguous(memory_format=torch.channels_last),
                    torch.randint(0, classes, (b,), generator=g)) for _ in range(n)]  # fmt: skip
        model = ImageLogits(m).to(memory_format=torch.channels_last).train()
        return model, batches, lambda out, y: F.cross_entropy(out.float(), y)
    vocab, seq, batch = 50257, 1024, 8
    m = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=vocab, n_positions=seq, n_embd=768, n_layer=12, n_head=12,
            use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)  # fmt: skip
    ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
    return big.Logits(m).train(), [(x, x) for x in ids], big.next_token_loss


def build(name: str, n: int, device: torch.device) -> tuple[torch.nn.Module, list[Any], Any]:
    """Model ``name`` (see the module docstring) on ``device`` with ``n`` batches."""
    if name in ("gpt2-124m", *CHANNELS_LAST):
        model, batches, loss = _issue41(name, n)
    elif name == "tiny":
        from bench.corpus import _hf

        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        m = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)  # fmt: skip
        ids = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(n)]
        model, batches, loss = big.Logits(m).train(), [(x, x) for x in ids], big.next_token_loss
    else:
        model, batches, loss = big.build(name, n)
    return model.to(device), [(x.to(device), t.to(device)) for x, t in batches], loss  # .to keeps channels_last


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def run(name: str, variants: list[str], device: torch.device, rounds: int, steps: int, warmup: int) -> None:
    """Prepare, warm up and time every variant of ``name``; one row per variant through :func:`emit`."""
    _, batches, _ = build(name, warmup + steps, device)
    state: dict[str, dict[str, Any]] = {}
    for variant in variants:
        if past_deadline(margin_s=30):
            emit({"phase": "train", "model": name, "variant": variant, "error": "skipped (the suite's time budget)"})
            continue
        try:
            _sync(device)
            before = _allocated(device)
            t0 = time.perf_counter()
            model, _, loss_fn = build(name, 0, device)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            step = big.make_step(variant, model, batches[0][0], loss_fn)
            prepare_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for x, target in batches[:warmup]:
                step(x, target)
            _sync(device)
            state[variant] = {"step": step, "params_m": params, "prepare_s": prepare_s,
                              "warmup_s": time.perf_counter() - t0, "kept": _allocated(device) - before,
                              "ms": [], "transient": 0, "loss": None}  # fmt: skip
        except Exception as exc:  # recorded: why a variant failed on this device
            traceback.print_exc()
            emit({"phase": "train", "model": name, "variant": variant,
                  "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"})  # fmt: skip
    timed = batches[warmup:]
    with gpu_lock() as waited:
        for rnd in range(rounds):
            for variant in list(state) if rnd % 2 == 0 else list(state)[::-1]:
                s = state[variant]
                try:
                    times = []
                    for i, (x, target) in enumerate(timed):
                        _sync(device)
                        if device.type == "cuda" and i == 0:
                            base = torch.cuda.memory_allocated()
                            torch.cuda.reset_peak_memory_stats()
                        t = time.perf_counter()
                        s["loss"] = s["step"](x, target)
                        times.append(time.perf_counter() - t)
                        if device.type == "cuda" and i == 0:
                            s["transient"] = max(s["transient"], torch.cuda.max_memory_allocated() - base)
                    s["ms"].append(1e3 * statistics.median(times))
                except Exception as exc:
                    traceback.print_exc()
                    s["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                    state.pop(variant)
                    emit({"phase": "train", "model": name, "variant": variant, "error": s["error"]})
    for variant, s in state.items():
        peak = (s["kept"] + s["transient"]) / 2**20 if device.type == "cuda" else float("nan")
        emit({"phase": "train", "model": name, "variant": variant, "params_m": s["params_m"],
              "step_ms": statistics.median(s["ms"]), "step_ms_rounds": s["ms"], "peak_mb": peak,
              "kept_mb": s["kept"] / 2**20, "prepare_s": s["prepare_s"], "first_step_s": s["warmup_s"] / warmup,
              "loss_last": s["loss"], "lock_wait_s": waited, "rounds": rounds, "steps": len(timed)})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=MODELS)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    # Issue 41's ratios are against FP32 with TF32 off; torch's default leaves cuDNN's TF32 on.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    run(args.model, args.variants.split(","), torch.device(args.device), args.rounds, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
