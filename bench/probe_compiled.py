"""Why is ``torch.compile`` of an amplite program slower than compiled autocast? (issue 31, step 1).

Times and profiles, in one process, ``torch.compile`` of: the autocast model, amplite O2 ``ep.module()``,
amplite O2's bare graph (no pre-forward hooks / guards fn / pytree), and the all-bf16 model.

    python bench/probe_compiled.py --model gpt2-6l --threads 1 --profile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amplite
from bench.bench_compiled import MODELS
from bench.corpus import CausalLogits, _hf, token_ids


def gpt2_tiny() -> tuple[torch.nn.Module, Any]:
    """GPT-2's graph at toy size (1 layer, d=64, 2 x 16 tokens): per-call overhead, not kernels, dominates."""
    m = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=1000, n_positions=64, n_embd=64, n_layer=1, n_head=2,
            attn_implementation="sdpa")
    return CausalLogits(m).eval(), ((), {"input_ids": token_ids(1000, 2, 16),
                                         "attention_mask": torch.ones(2, 16, dtype=torch.long)})


PROBES = {**MODELS, "gpt2-tiny": gpt2_tiny}


def _t(fn: Any, reps: int) -> float:
    fn()
    s = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - s) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-6l")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--variants", default="")
    p.add_argument("--fused", action="store_true")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    if a.profile:
        torch._inductor.config.cpp.enable_kernel_profile = True  # before compiling: kernels named in the profile
    torch.set_num_threads(a.threads)
    model, (args, kwargs) = PROBES[a.model]()
    fns: dict[str, Any] = {}

    def autocast(*x: Any, **k: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*x, **k)

    with torch.no_grad():
        fns["autocast"] = (autocast, (args, kwargs))
        o2 = amplite.convert(model, (args, kwargs), precision="bf16", level="O2", verify=False)
        fns["O2 ep.module()"] = (o2.module(), (args, kwargs))
        bare = o2.program.module(check_guards=False)
        bare.validate_inputs = False  # no pre-forward input check, no guards fn: the graph alone
        fns["O2 bare graph"] = (bare, (args, kwargs))
        if a.fused:
            o2f = amplite.convert(model, (args, kwargs), precision="bf16", level="O2", verify=False,
                                  fuse_contractions=True)
            fns["O2 fused ep.module()"] = (o2f.module(), (args, kwargs))
        low = copy.deepcopy(model).to(torch.bfloat16)
        low_args = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in args)
        fns["all bf16"] = (low, (low_args, kwargs))
        if a.variants:
            fns = {k: v for k, v in fns.items() if k in a.variants.split(",")}
        runs = {}
        for name, (fn, (pos, kw)) in fns.items():
            c = torch.compile(fn)
            s = time.perf_counter()
            c(*pos, **kw)
            print(f"{name}: compile {time.perf_counter() - s:.1f} s", file=sys.stderr, flush=True)
            runs[name] = (lambda c=c, pos=pos, kw=kw: c(*pos, **kw))
            runs[name + " [eager]"] = (lambda f=fn, pos=pos, kw=kw: f(*pos, **kw))
        samples: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(a.rounds):
            for k, f in runs.items():
                samples[k].append(_t(f, a.reps))
                print(f"round {r} {k}: {samples[k][-1]:.2f} ms", file=sys.stderr, flush=True)
        for k, v in samples.items():
            print(f"{k:32s} median {statistics.median(v):8.2f} ms  min {min(v):8.2f}  all {[round(x, 1) for x in v]}")
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            for k in fns:
                f = runs[k]
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        f()
                print(f"\n===== {k} (3 calls)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
