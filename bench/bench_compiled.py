"""Compiled deployment: eager, ``torch.compile`` and AOTInductor, side by side in one process (issue 31).

For each model and variant — FP32, ``torch.autocast`` bf16, amplite bf16 O1 and O2, and the whole model cast to
bf16 (the all-low-precision limit) — the forward is timed eager, under ``torch.compile`` and as an AOTInductor
package (autocast has no AOTInductor row: a package has no autocast context). The repetitions are interleaved
(every variant once per round, rounds repeated) and the table gives medians; the ratios are the targets of
issue 31: compiled amplite O2 ≤ 1.0× compiled autocast and ≤ 1.05× the compiled all-bf16 model, AOTInductor
likewise, amplite O1 ≤ 1.0× autocast.

    python bench/bench_compiled.py --models fx-mlp,fx-transformer,fx-causal --rounds 5
    python bench/bench_compiled.py --models gpt2-6l --threads 1 --rounds 3 --out bench/results-compiled-models.json

Prints a Markdown table; ``--out`` also writes the JSON and ``--markdown`` the table to a file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amplite
from bench.corpus import CASES, CausalLogits, _hf, token_ids

LOW = torch.bfloat16


def gpt2_6l() -> tuple[torch.nn.Module, Any]:
    """Issue 31's GPT-2-style model: GPT2LMHeadModel from config, 6 layers, d=512, 8 heads, 4 x 256 tokens."""
    m = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=50257, n_positions=1024, n_embd=512, n_layer=6,
            n_head=8, attn_implementation="sdpa")
    return CausalLogits(m).eval(), ((), {"input_ids": token_ids(50257, 4, 256),
                                         "attention_mask": torch.ones(4, 256, dtype=torch.long)})


#: Every model this benchmark knows: the corpus plus issue 31's GPT-2-style model.
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    **{k: c.build for k, c in CASES.items()}, "gpt2-6l": gpt2_6l}
MODES = ("eager", "compile", "aoti")


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs
    )


def variants(model: torch.nn.Module, inputs: Any) -> dict[str, tuple[Callable[..., Any], Any, Any]]:
    """name -> (callable to run, its inputs, an ExportedProgram for AOTInductor or None)."""
    args, kwargs = inputs
    fp32 = torch.export.export(model, args, kwargs)
    out: dict[str, tuple[Callable[..., Any], Any, Any]] = {"fp32": (model, inputs, fp32)}

    def autocast(*a: Any, **k: Any) -> Any:
        with torch.autocast("cpu", dtype=LOW):
            return model(*a, **k)

    out["autocast"] = (autocast, inputs, None)
    for level in ("O1", "O2"):
        res = amplite.convert(model, inputs, precision="bf16", level=level, verify=False)
        out[f"amplite {level}"] = (res.module(), inputs, res.program)
    low = copy.deepcopy(model).to(LOW)
    low_inputs = _cast_inputs(inputs, LOW)
    out["all bf16"] = (low, low_inputs, torch.export.export(low, *low_inputs))
    return out


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def bench_model(name: str, rounds: int, reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    model, inputs = MODELS[name]()
    runs: dict[tuple[str, str], Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for vname, (fn, (args, kwargs), program) in variants(model, inputs).items():
            runs[(vname, "eager")] = lambda fn=fn, a=args, k=kwargs: fn(*a, **k)
            compiled = torch.compile(fn)
            start = time.perf_counter()
            compiled(*args, **kwargs)
            compile_s[f"{vname} compile"] = time.perf_counter() - start
            runs[(vname, "compile")] = lambda fn=compiled, a=args, k=kwargs: fn(*a, **k)
            if program is not None:
                start = time.perf_counter()
                path = torch._inductor.aoti_compile_and_package(program, package_path=f"{tmp}/{len(runs)}.pt2")
                compile_s[f"{vname} aoti"] = time.perf_counter() - start
                package = torch._inductor.aoti_load_package(path)
                runs[(vname, "aoti")] = lambda fn=package, a=args, k=kwargs: fn(*a, **k)
            log(f"  {name}: {vname} ready ({time.strftime('%H:%M:%S')})")
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        for _ in range(rounds):  # interleaved: each variant once per round
            for key, fn in runs.items():
                samples[key].append(_time(fn, reps))
    medians = {f"{v} | {m}": statistics.median(s) for (v, m), s in samples.items()}
    return {"model": name, "median_ms": medians, "compile_s": compile_s, "rounds": rounds, "reps": reps}


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    med = result["median_ms"]

    def r(a: str, b: str) -> float | None:
        return round(med[a] / med[b], 3) if a in med and b in med else None

    return {
        "compiled O2 / compiled autocast (≤ 1.0)": r("amplite O2 | compile", "autocast | compile"),
        "compiled O2 / compiled all-bf16 (≤ 1.05)": r("amplite O2 | compile", "all bf16 | compile"),
        "AOTI O2 / AOTI all-bf16 (≤ 1.05)": r("amplite O2 | aoti", "all bf16 | aoti"),
        "AOTI O2 / compiled autocast (≤ 1.0)": r("amplite O2 | aoti", "autocast | compile"),
        "compiled O1 / compiled autocast (≤ 1.0)": r("amplite O1 | compile", "autocast | compile"),
        "eager O1 / eager autocast (≤ 1.0)": r("amplite O1 | eager", "autocast | eager"),
        "eager O2 / eager autocast (≤ 1.0)": r("amplite O2 | eager", "autocast | eager"),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    names = ("fp32", "autocast", "amplite O1", "amplite O2", "all bf16")
    lines = ["| model | variant | eager ms | torch.compile ms | AOTInductor ms |", "|---|---|---|---|---|"]
    for res in results:
        for v in names:
            cells = [res["median_ms"].get(f"{v} | {m}") for m in MODES]
            shown = [f"{c:.2f}" if c is not None else "–" for c in cells]
            lines.append(f"| {res['model']} | {v} | " + " | ".join(shown) + " |")
    lines += ["", "| model | ratio (target) | value | met |", "|---|---|---|---|"]
    for res in results:
        for label, value in ratios(res).items():
            bound = float(label.rsplit("≤ ", 1)[1].rstrip(")"))
            met = "–" if value is None else ("yes" if value <= bound else "**no**")
            lines.append(f"| {res['model']} | {label} | {value if value is not None else '–'} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="fx-mlp,fx-transformer,fx-causal")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    results: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = [round(x, 2) for x in os.getloadavg()]

    def write() -> None:  # after every model: a run stopped part-way keeps what it measured
        if args.out:
            args.out.write_text(json.dumps({
                "results": results, "ratios": [ratios(r) for r in results], "failed": failed,
                "torch": torch.__version__, "threads": args.threads, "started": started, "load_start": load,
                "load_now": [round(x, 2) for x in os.getloadavg()], "models": args.models.split(","),
            }, indent=1))  # fmt: skip

    for name in args.models.split(","):
        try:
            results.append(bench_model(name, args.rounds, args.reps, lambda s: print(s, file=sys.stderr)))
        except Exception as exc:  # one model failing must not lose the others
            failed[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"  {name}: FAILED {failed[name]}", file=sys.stderr)
        write()
    table = markdown(results)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
