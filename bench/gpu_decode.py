"""Decode and prefill with amplite's LLM step program on the GPU (issue 41; a job of bench/gpu_suite.py).

GPT-2 124 M (12 layers, d 768, vocab 50257; ``--dry-run``: bench/decode_count.py's 2-layer stand-in) through
the step signature of ``amplite.llm.step`` (input ids, mask, KV cache in and out), variants as in
bench/decode_count.py: the FP32 step (TF32 off), the all-bf16 model, autocast bf16, and amplite O1/O2 bf16
(``convert_llm``, run by ``LLMProgram.runner()`` as ``generate()`` runs it; the cache crosses in bf16).

Per batch (1 and 32) and variant: the median latency of one decode step after a 128-token prompt and of the
prefill of that prompt (CUDA events), and what one decode step launches: CUDA kernels counted by the
profiler on the GPU (aten compute ops on the CPU), and casts. Timed interleaved inside one hold of the GPU
lock. Rows go to ``emit`` (phase ``decode``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import decode_count as dc  # noqa: E402
from bench.gpu_contract import timeit  # noqa: E402
from bench.gpu_jobs import emit, gpu_lock, past_deadline  # noqa: E402

LABELS = {"fp32": "fp32 (TF32 off)", "all-bf16": "all-bf16", "autocast-bf16": "autocast bf16",
          "amplite-O1": "amplite O1 bf16", "amplite-O2": "amplite O2 bf16"}  # fmt: skip


def build(dry: bool) -> tuple[torch.nn.Module, str]:
    if dry:
        return dc.tiny_gpt2(), "tiny-gpt2"
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    return transformers.GPT2LMHeadModel(cfg).eval(), "gpt2-124m"


def _converted_on_cpu(model: torch.nn.Module, level: str, device: torch.device) -> tuple[Any, torch.dtype]:
    """``convert_llm`` on a CPU copy, the program moved to ``device`` (``move_to_device_pass``)."""
    import copy

    from amplite.llm import convert_llm
    from amplite.llm.result import LLMProgram

    llm = convert_llm(copy.deepcopy(model).cpu(), precision="bf16", level=level, verify=False).llm
    moved = torch.export.passes.move_to_device_pass(llm.program, device)
    return LLMProgram(moved, llm.shape, llm.cache_dtype).runner().step, llm.cache_dtype


def kernels_per_step(fn: Any, device: torch.device) -> dict[str, int]:
    """CUDA kernels and casts one call launches (profiler); on the CPU, aten compute ops and casts."""
    if device.type != "cuda":
        counter = dc.StepCounter(cache_numel=1 << 62)
        with counter:
            fn()
        return {"kernels": counter.kernels, "casts": counter.summary()["casts"]}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    casts = sum(1 for e in events if e.name == "aten::_to_copy")
    return {"kernels": kernels, "casts": casts}


def run(dry: bool, device: torch.device, batches: list[int], past: int, warmup: int, iters: int) -> None:
    from amplite.llm.step import cache_shape

    model, name = build(dry)
    model = model.to(device)
    shape, vocab = cache_shape(model), model.config.vocab_size
    made: dict[str, tuple[Any, torch.dtype]] = {}
    for v in dc.VARIANTS:
        if past_deadline(margin_s=60):
            emit({"phase": "decode", "model": name, "variant": LABELS[v], "error": "not run: budget"})
            continue
        try:
            try:
                made |= dc.steps(model, (v,), device.type)
            except Exception:
                if not v.startswith("amplite") or device.type == "cpu":
                    raise
                traceback.print_exc()  # converting on the GPU failed: convert on the CPU, move the program
                made[v] = _converted_on_cpu(model, v.split("-")[1], device)
                why = "converted on the CPU and moved to the GPU (converting on the GPU failed: see the log)"
                emit({"phase": "note", "model": name, "variant": LABELS[v], "note": why})
        except Exception as exc:  # recorded: why a variant cannot be built on this device
            traceback.print_exc()
            emit({"phase": "decode", "model": name, "variant": LABELS[v],
                  "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"})  # fmt: skip
    for batch in batches:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, past), generator=g).to(device)
        mask, mask1 = (torch.ones(batch, n, dtype=torch.long, device=device) for n in (past, past + 1))
        calls = {}
        with torch.no_grad():
            for v, (step, dtype) in made.items():
                empty = shape.empty(batch, dtype, device)
                logits, keys, values = step(ids, mask, empty, empty)
                token = logits[:, -1].argmax(-1)[:, None]
                calls[v] = {"prefill": lambda s=step, i=ids, m=mask, e=empty: s(i, m, e, e),
                            "decode": lambda s=step, t=token, m=mask1, k=keys, vv=values: s(t, m, k, vv)}  # fmt: skip
            ms: dict[tuple[str, str], list[float]] = {}
            with gpu_lock():
                for rnd in range(2 if dry else 3):
                    for v in list(calls) if rnd % 2 == 0 else list(calls)[::-1]:
                        for what, fn in calls[v].items():
                            ms.setdefault((v, what), []).append(timeit(fn, device, warmup, iters))
                counts = {v: kernels_per_step(c["decode"], device) for v, c in calls.items()}
        base = {what: statistics.median(ms[("fp32", what)]) for what in ("prefill", "decode") if ("fp32", what) in ms}
        for (v, what), times in ms.items():
            row = {"phase": "decode", "model": name, "batch": batch, "variant": LABELS[v], "step": what,
                   "ms": statistics.median(times), "past": past}  # fmt: skip
            if what in base:
                row["vs_fp32"] = row["ms"] / base[what]
            if what == "decode":
                row |= counts[v]
            emit(row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # FP32 means TF32 off
    device = torch.device("cpu" if args.dry_run else args.device)
    batches, past = ([1, 2], 8) if args.dry_run else ([1, 32], 128)
    run(args.dry_run, device, batches, past, *((1, 2) if args.dry_run else (5, 20)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
