"""The trained tiny LM of ``bench_fp8_lm.py`` converted as a module (``--precision fp8``, not a checkpoint).

The same seeded training (``bench_fp8_lm.train``) and held-out token streams; the model is then converted with
``amplite.convert(model, inputs, precision="fp8", calibration=<4 batches>, fallback_search=False)`` (every
eligible product in FP8) — with the weight scales chosen by measured output error (*fp8 static*) and with each
weight channel at its own amax/448 (*act-only static*) — and compared, side by side in this run, with the vLLM
on-the-fly baseline (``bench_fp8.per_tensor_dynamic``: per-tensor weight and per-tensor dynamic activation
scales around every ``nn.Linear``, the rest FP32). Logit SQNR and KL against FP32 on the evaluation stream.

    python bench/bench_fp8_lm_module.py [--steps 120] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Logits(torch.nn.Module):
    """``input_ids -> logits`` without a cache (one prefill)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    import amplite
    from bench.bench_fp8 import per_tensor_dynamic, plain_weight_scales
    from bench.bench_fp8_lm import SEQ, fidelity, markov, stream, train
    from bench.harness import machine

    print(f"machine: {machine()[0]}; torch {torch.__version__}", flush=True)
    probs = markov()
    t0 = time.perf_counter()
    model, loss, ent = train(ns.steps, probs)
    print(f"trained {ns.steps} steps in {time.perf_counter() - t0:.0f} s, loss {loss:.3f} (entropy {ent:.3f})")
    net = Logits(model).eval()
    evals = stream(probs, 8, SEQ, seed=8).split(4)  # the program is exported at the calibration batches' shape
    calib = [(stream(probs, 4, SEQ, seed=9 + i),) for i in range(4)]

    def run(f: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([f(ids).float() for ids in evals])

    ref = run(net)
    with per_tensor_dynamic(net):
        rows = {"vLLM on-the-fly baseline (per-tensor dynamic)": fidelity(ref, run(net))}
    for label, ctx in (("fp8 static", None), ("act-only static", plain_weight_scales)):
        if ctx is None:
            r = amplite.convert(net, (calib[0][0],), precision="fp8", calibration=calib, fallback_search=False)
        else:
            with ctx():
                r = amplite.convert(net, (calib[0][0],), precision="fp8", calibration=calib, fallback_search=False)
        fp8 = sum(e["dtype"] == "float8_e4m3fn" for e in r.report.data["plan"])
        rows[f"{label} ({fp8} FP8 products)"] = fidelity(ref, run(r.program.module()))
    print("| run | logit SQNR (dB) | KL (nats/token) |\n|---|---|---|")
    for k, (sqnr, kl) in rows.items():
        print(f"| {k} | {sqnr:.2f} | {kl:.3g} |")


if __name__ == "__main__":
    main()
