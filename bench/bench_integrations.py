"""The framework integrations side by side: amplite's plugin/Trainer vs the framework's own bf16 autocast.

Usage::

    python bench/bench_integrations.py [--steps 60] [--variants ...] [--json OUT]

Rows: Lightning ``Trainer(precision="bf16-mixed")`` vs ``Trainer(plugins=[AmplitePrecision("bf16", level)])``
and transformers ``Trainer(bf16=True)`` vs ``AmpliteTrainer`` (O1, O2), on the tiny GPT-2 of the examples
(examples/train_lightning.py, examples/train_transformers.py) widened to 64 channels, fixed-length batches.

Every variant runs in a fresh subprocess. Step time: the median over the optimizer steps after 5 warm-up steps
(the framework's whole step: forward, backward, clipping, optimizer, scheduler, logging). The first step
(amplite's trace) is reported apart as ``first_s``. Peak memory: on CUDA ``torch.cuda.max_memory_allocated``;
on CPU the peak resident set during the measured steps (Linux ``VmHWM``, reset after the warm-up) minus the
resident set before training, which on these tiny models is dominated by one-off costs (see bench_train.py).
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = ["lightning-bf16-mixed", "lightning-amplite-O1", "lightning-amplite-O2",
            "hf-bf16", "hf-amplite-O1", "hf-amplite-O2"]  # fmt: skip
WARMUP = 5


def _widen(gpt: Any) -> Any:
    import transformers

    cfg = gpt.config
    cfg.n_embd, cfg.n_head = 64, 4
    import torch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.accepts_loss_kwargs = False
    return model


def run_lightning(variant: str, steps: int, times: list[float]) -> None:
    import lightning.pytorch as pl
    import torch
    import train_lightning as ex

    from amplite.integrations.lightning import AmplitePrecision

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            self.t0 = perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            times.append(perf_counter() - self.t0)
            if len(times) == WARMUP:
                _reset_peak()

    pl.seed_everything(0, verbose=False)
    model = ex.TinyGPT(steps=steps)
    model.gpt = _widen(model.gpt)
    data = torch.utils.data.DataLoader(ex.token_data(ex.BATCH * steps, seed=0), batch_size=ex.BATCH)
    level = variant.rsplit("-", 1)[1]
    prec = {"precision": "bf16-mixed"} if variant.endswith("bf16-mixed") else {
        "plugins": [AmplitePrecision("bf16", level=level)]}  # fmt: skip
    trainer = pl.Trainer(max_steps=steps, accelerator="auto", devices=1, gradient_clip_val=1.0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[Timer()], **prec)  # fmt: skip
    trainer.fit(model, data)


def run_hf(variant: str, steps: int, times: list[float]) -> None:
    import train_transformers as ex
    import transformers

    from amplite.integrations.transformers import AmpliteTrainer

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(perf_counter() - self.t0)
            if len(times) == WARMUP:
                _reset_peak()

    args = transformers.TrainingArguments(
        output_dir="/tmp/bench-integrations", max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=1, bf16=True, seed=0, report_to=[], save_strategy="no", disable_tqdm=True,
        use_cpu=not _cuda(),
    )  # fmt: skip
    model, data = _widen(ex.tiny_gpt2()), ex.TokenData(4 * steps, seed=0)
    if variant == "hf-bf16":
        trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[Timer()])
    else:
        trainer = AmpliteTrainer(model, args, train_dataset=data, callbacks=[Timer()],
                                 amplite_level=variant.rsplit("-", 1)[1])  # fmt: skip
    trainer.train()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def run_one(variant: str, steps: int) -> dict[str, Any]:
    """One variant in this process: step times and peak memory."""
    import torch

    warnings.filterwarnings("ignore")
    times: list[float] = []
    base = torch.cuda.memory_allocated() / 2**20 if _cuda() else _status_mb("VmRSS")
    (run_lightning if variant.startswith("lightning") else run_hf)(variant, steps, times)
    peak = torch.cuda.max_memory_allocated() / 2**20 if _cuda() else _status_mb("VmHWM") - base
    return {"variant": variant, "steps": len(times), "first_s": times[0],
            "step_ms": 1000 * statistics.median(times[WARMUP:]), "peak_mb": peak,
            "device": "cuda" if _cuda() else "cpu"}  # fmt: skip


def render(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, each amplite row beside its framework's own bf16 row."""
    base = {r["variant"].split("-")[0]: r for r in rows if r["variant"] in ("lightning-bf16-mixed", "hf-bf16")}
    out = ["| variant | first step (s) | step (ms) | vs framework bf16 | peak memory (MiB) | vs framework bf16 |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        b = base.get(r["variant"].split("-")[0])
        t = f"{r['step_ms'] / b['step_ms']:.2f}x" if b else "-"
        m = f"{r['peak_mb'] / b['peak_mb']:.2f}x" if b and b["peak_mb"] > 0 else "-"
        out.append(f"| {r['variant']} | {r['first_s']:.2f} | {r['step_ms']:.1f} | {t} | {r['peak_mb']:.1f} | {m} |")
    return "\n".join(out)


SECTION = "## Training: framework integrations (bench/bench_integrations.py)"


def splice(doc: str, section: str) -> str:
    """``doc`` with :data:`SECTION` replaced by ``section``, or inserted after the "Training" section."""
    lines = doc.splitlines()

    def end_of(start: int) -> int:
        return next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))

    if SECTION in lines:
        i = lines.index(SECTION)
        lines[i : end_of(i)] = [*section.splitlines(), ""]
    else:
        i = next((n for n, ln in enumerate(lines) if ln == "## Training"), len(lines) - 1)
        at = end_of(i)
        lines[at:at] = [*section.splitlines(), ""]
    return "\n".join(lines) + "\n"


def median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: the median of its rounds' step time, first step and peak memory."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        out.setdefault(r["variant"], {"variant": r["variant"], "steps": r["steps"], "device": r["device"], "_": []})
        out[r["variant"]]["_"].append(r)
    for row in out.values():
        rounds = row.pop("_")
        for key in ("first_s", "step_ms", "peak_mb"):
            row[key] = statistics.median(x[key] for x in rounds)
        row["rounds"] = len(rounds)
        row["step_ms_all"] = [round(x["step_ms"], 2) for x in rounds]
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every variant (medians)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--write", action="store_true", help="put the table into bench/RESULTS.md")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.steps)))
        return
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for rnd in range(args.rounds):  # interleaved: every variant once per round, so drifting load hits all alike
        for variant in args.variants.split(","):
            done = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=False)  # fmt: skip
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                raise SystemExit(f"{variant} failed:\n{done.stderr[-2000:]}")
            runs.append(json.loads(line[-1][len("RESULT ") :]))
            print(f"round {rnd + 1} {variant}: {runs[-1]['step_ms']:.1f} ms/step, {runs[-1]['peak_mb']:.1f} MiB",
                  file=sys.stderr)  # fmt: skip
    rows = median_rows(runs)
    load_after = [round(x, 2) for x in os.getloadavg()]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table = render(rows)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.write:
        import torch

        section = "\n".join([
            SECTION, "",
            f"`python bench/bench_integrations.py --steps {args.steps} --rounds {args.rounds} --write` on {when}, "
            f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, device "
            f"{rows[0]['device']}; load average {load_before} at the start, {load_after} at the end. Each variant "
            "ran in a fresh process, the variants interleaved round by round; figures are medians of the rounds "
            "(the step-time column: the median over the steps after 5 warm-up steps of the framework's whole "
            "step). The tiny GPT-2 of examples/train_lightning.py and examples/train_transformers.py, 64 "
            "channels, fixed-length batches. On CPU the memory column is the resident-set peak, which on a model "
            "this small is dominated by amplite's one-off resident cost (see Training's note).",
            "", table, "",
        ])  # fmt: skip
        results = ROOT / "bench" / "RESULTS.md"
        results.write_text(splice(results.read_text(), section))


if __name__ == "__main__":
    main()
