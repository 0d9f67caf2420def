"""Activation checkpointing: amplite against ``torch.autocast``, each with and without checkpointing (issue 43).

Usage::

    flock /tmp/amplite-bench.lock python bench/bench_train_ckpt.py [--rounds 2] [--steps 3] [--write]

Model: ``transformers.GPT2LMHeadModel`` from a config (no download): ``--layers`` (4) layers, ``--width`` (256)
channels, 4 heads, vocab 4096, seq ``--seq`` (512), batch ``--batch`` (4), dropout 0.1. Checkpointing is
``model.gradient_checkpointing_enable()`` (one region per block), the same model object for both precisions.

Variants: ``autocast`` / ``autocast-ckpt`` (``torch.autocast("cpu", bfloat16)``), ``amplite-O1`` / ``-O1-ckpt``
and ``amplite-O2`` / ``-O2-ckpt`` (``prepare_training(..., precision="bf16")``). Every step: forward, loss,
backward, AdamW step, zero_grad. Each variant runs in a fresh process, round by round interleaved; figures are
medians over rounds.

Measured per variant: step time (median of the timed steps), peak memory (the resident-set peak during the
timed steps, Linux ``VmHWM`` reset after the warm-up, minus the resident set after building the model and its
batches), and the bytes autograd saves for backward in one step (unique storages, through
``torch.autograd.graph.saved_tensors_hooks``; under checkpointing only what lives outside the recomputed regions
is saved, so this column is the activation memory checkpointing leaves; weights are not counted).
``--write`` puts the table under "Training" in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.bench_train import _status_mb, _trim_and_reset_peak  # noqa: E402
from bench.bench_train_big import write_part  # noqa: E402

VARIANTS = ["autocast", "autocast-ckpt", "amplite-O1", "amplite-O1-ckpt", "amplite-O2", "amplite-O2-ckpt"]
MARK = "### Activation checkpointing (bench/bench_train_ckpt.py)"
VOCAB = 4096


def build(args: argparse.Namespace, ckpt: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The GPT-2 and ``warmup + steps`` batches of token ids (seeded)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                                  n_head=4, use_cache=False, attn_implementation="sdpa")  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator().manual_seed(1)
    n = args.warmup + args.steps + 1  # + the step that measures the saved bytes
    return model, [torch.randint(0, VOCAB, (args.batch, args.seq), generator=g) for _ in range(n)]


def run_one(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant; step time, peak memory, bytes saved for backward, the last loss."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    model, batches = build(args, variant.endswith("-ckpt"))
    _trim_and_reset_peak()
    rss_base = _status_mb("VmRSS")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd, backward, autocast, info = model, None, variant.startswith("autocast"), {}
    if not autocast:
        import amplite

        level = variant.split("-")[1]
        example = ((), {"input_ids": batches[0], "labels": batches[0]})
        fwd, opt = amplite.prepare_training(model, opt, example, precision="bf16", level=level, dynamic_batch=False)
        info = {"regions": fwd.info["checkpointed_regions"]}
        backward = opt.backward
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {t.untyped_storage().data_ptr() for pair in getattr(opt, "pairs", []) for t in pair}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    times, losses = [], []
    for i, ids in enumerate(batches):
        if i == args.warmup:
            _trim_and_reset_peak()
        torch.manual_seed(1000 + i)
        measure = i == len(batches) - 1  # the hooks cost time: only in the last step, which is not timed
        t = perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x) if measure else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = fwd(input_ids=ids, labels=ids).loss
            (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
        if not measure:
            times.append(perf_counter() - t)
        losses.append(loss.item())
    return {"variant": variant, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "step_ms": 1000 * statistics.median(times[args.warmup:]), "peak_mb": _status_mb("VmHWM") - rss_base,
            "saved_mb": sum(saved.values()) / 2**20, "loss_last": losses[-1], **info}  # fmt: skip


def run_sub(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in a fresh process."""
    cmd = [sys.executable, __file__, "--one", variant] + [f"--{k}={getattr(args, k)}" for k in _SIZES]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        return {"variant": variant, "error": last[-1][:200]}


_SIZES = ("layers", "width", "seq", "batch", "steps", "warmup", "threads")


def _cpu_bf16() -> str:
    """What /proc/cpuinfo says about native bf16 (read, not assumed)."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "CPU flags unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return "native bf16: " + ", ".join(have) if have else "no native bf16 (AVX2-class: bf16 matmuls are emulated)"


def render(rows: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The Markdown part: the table, then the ratios (checkpointed amplite against checkpointed autocast)."""
    lines = [MARK, "", f"`{meta['command']}` on {meta['when']}, {meta['machine']}; {meta['bf16']}; load average "
             f"{meta['load'][0]} at the start, {meta['load'][1]} at the end. GPT-2 {meta['params_m']:.1f} M parameters "
             f"({meta['shape']}), one process per variant, {meta['rounds']} rounds interleaved, medians. Peak = "
             "resident-set peak during the timed steps minus the resident set after building the model; saved = "
             "bytes autograd saved for backward in one step outside the recomputed regions (weights excluded).",
             "", "| variant | step ms | peak MiB | saved for backward MiB | regions | loss |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for v in VARIANTS:
        r = rows.get(v, {})
        if "error" in r or not r:
            lines.append(f"| {v} | failed: {r.get('error', 'no result')} | | | | |")
            continue
        lines.append(f"| {v} | {r['step_ms']:.0f} | {r['peak_mb']:.0f} | {r['saved_mb']:.1f} | "
                     f"{r.get('regions', '–')} | {r['loss_last']:.3f} |")  # fmt: skip
    lines += ["", "| ratio (measured in this run) | value |", "|---|---|"]
    for a, b in [("autocast-ckpt", "autocast"), ("amplite-O1-ckpt", "amplite-O1"), ("amplite-O2-ckpt", "amplite-O2"),
                 ("amplite-O1-ckpt", "autocast-ckpt"), ("amplite-O2-ckpt", "autocast-ckpt")]:  # fmt: skip
        ra, rb = rows.get(a, {}), rows.get(b, {})
        for key, what in (("peak_mb", "peak memory"), ("saved_mb", "saved for backward"), ("step_ms", "step time")):
            if key in ra and key in rb and rb[key]:
                lines.append(f"| {a} / {b} {what} | {ra[key] / rb[key]:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process (one more measures the saved bytes)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per process")
    ap.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md (Training)")
    ap.add_argument("--one", metavar="VARIANT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    load_before = [round(x, 2) for x in os.getloadavg()]
    variants = args.variants.split(",")
    rounds: list[dict[str, dict[str, Any]]] = []
    for rnd in range(args.rounds):
        got = {}
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            got[v] = run_sub(v, args)
            print(rnd, json.dumps(got[v]), flush=True)
        rounds.append(got)
    rows: dict[str, dict[str, Any]] = {}
    for v in variants:
        ok = [r[v] for r in rounds if "error" not in r[v]]
        if not ok:
            rows[v] = rounds[-1][v]
            continue
        rows[v] = {k: statistics.median(r[k] for r in ok) if isinstance(ok[0][k], float) else ok[0][k] for k in ok[0]}
    params = next((r["params_m"] for r in rows.values() if "params_m" in r), 0.0)
    meta = {"command": "python bench/bench_train_ckpt.py " + " ".join(sys.argv[1:]),
            "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{args.threads} threads",
            "bf16": _cpu_bf16(), "load": (load_before, [round(x, 2) for x in os.getloadavg()]),
            "params_m": params, "rounds": args.rounds,
            "shape": f"{args.layers} layers, n_embd {args.width}, vocab {VOCAB}, seq {args.seq}, "
                     f"batch {args.batch}"}  # fmt: skip
    part = render(rows, meta)
    print(part)
    if args.write:
        write_part(part, MARK)


if __name__ == "__main__":
    main()
