"""Where static FP8 scales lose to per-tensor dynamic scaling: per layer and end to end (issue 42).

Usage: ``python bench/probe_fp8_scales.py MODEL [MODEL ...]`` (``bench/corpus.py`` names, e.g. ``vit-b16
fx-mlp``). Every ``nn.Linear`` of the FP32 model is emulated in FP32 around the layer (the rest of the model
FP32, as ``bench_fp8.per_tensor_dynamic`` runs the baseline), with its inputs calibrated on the two batches
``bench_fp8`` calibrates on and judged on its held-out ones.

Per layer (SQNR of ``x̂ Ŵᵀ`` against ``x Wᵀ`` on the held-out inputs), the activation scale — ``static``
(``fp8_scales``' choice on the calibration inputs), ``amax448`` (static amax/448), ``dynamic`` (per-tensor
amax/448 of each batch: the baseline's) — each with the weight per output channel at amax/448 (``pc``), per
tensor (``pt``, the baseline's) or per channel chosen by the measured output error (``meas``,
``fp8_scales.weight_amaxes``). The printed summary is the mean per-layer SQNR of each pair and the largest
per-layer gap between static and dynamic activations; end to end, the SQNR of the first output pooled
over the held-out batches for the same pairs, and for the weights at fixed alignments ``amax·2^(k/8)`` (same
per-layer error, different rounding). Everything printed is measured in this run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from amplite.converter.fp8_scales import candidate_amaxes, pick, quantization_error, weight_amaxes
from amplite.ops.fp8_numerics import dequantize, quantize, scale_from_amax
from bench.bench_fp8 import EVAL_BATCHES, _first, calibration_batches, pooled_sqnr

ACTS, WEIGHTS = ("static", "amax448", "dynamic"), ("pc", "pt", "meas")


def _q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, scale), scale)


def probe(name: str) -> None:
    from bench.corpus import CASES

    model, (args, kwargs) = CASES[name].build()
    calib = calibration_batches((args, kwargs))
    held = [(args, kwargs), *calibration_batches((args, kwargs), n=EVAL_BATCHES + 2)[2:]]
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}

    def record(tag: str, batches: list) -> None:
        hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.setdefault((tag, n), []).append(
            a[0].detach().float().reshape(-1, a[0].shape[-1]))) for n, m in linears]  # fmt: skip
        with torch.no_grad():
            for a, k in batches:
                model(*a, **k)
        for h in hooks:
            h.remove()

    record("calib", calib)
    record("held", held)
    act_amax: dict[str, dict[str, float]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    per_layer: dict[tuple[str, str], list[float]] = {}
    for n, m in linears:
        w, cx = m.weight.detach().float(), seen[("calib", n)]
        amax = max(float(x.abs().max()) for x in cx)
        cands = candidate_amaxes(amax)
        act_amax[n] = {"static": pick(cands, sum(quantization_error(x, cands) for x in cx)), "amax448": amax}
        with torch.no_grad():
            weights[n] = {"pc": _q(w, scale_from_amax(w.abs().amax(1, keepdim=True))),
                          "pt": _q(w, scale_from_amax(w.abs().max())),
                          "meas": _q(w, scale_from_amax(weight_amaxes(w, torch.cat(cx))[:, None]))}  # fmt: skip
        for act in ACTS:
            for wk in WEIGHTS:
                sig = err = 0.0
                for x in seen[("held", n)]:
                    s = scale_from_amax(x.abs().max() if act == "dynamic" else act_amax[n][act])
                    y = x @ w.t()
                    sig += float(y.double().pow(2).sum())
                    err += float((_q(x, s) @ weights[n][wk].t() - y).double().pow(2).sum())
                per_layer.setdefault((act, wk), []).append(10 * math.log10(sig / err))
    print(f"{name}: {len(linears)} linears; mean per-layer SQNR (dB) on held-out inputs, activation/weight:")
    print("  " + ", ".join(f"{a}/{w} {sum(v) / len(v):.2f}" for (a, w), v in per_layer.items()))
    gap = [s - d for s, d in zip(per_layer[("static", "pc")], per_layer[("dynamic", "pc")], strict=True)]
    print(f"  static - dynamic activations per layer (pc weights): {min(gap):+.2f} … {max(gap):+.2f} dB")

    def e2e(act: str, wk: str | float) -> float:
        hooks = []
        for n, m in linears:
            w = weights[n][wk] if isinstance(wk, str) else _q(m.weight.detach().float(), scale_from_amax(
                m.weight.detach().float().abs().amax(1, keepdim=True) * 2 ** (wk / 8)))  # fmt: skip

            def hook(mod: nn.Module, a: tuple, out: torch.Tensor, n: str = n, w: torch.Tensor = w) -> torch.Tensor:
                x = a[0].float()
                y = _q(x, scale_from_amax(x.abs().max() if act == "dynamic" else act_amax[n][act])) @ w.t()
                return y + mod.bias if mod.bias is not None else y

            hooks.append(m.register_forward_hook(hook))
        with torch.no_grad():
            outs = [_first(model(*a, **k)).float() for a, k in held]
        for h in hooks:
            h.remove()
        return pooled_sqnr(refs, outs)

    with torch.no_grad():
        refs = [_first(model(*a, **k)).float() for a, k in held]
    print(f"{name}: end to end (rest FP32), activation/weight: " + ", ".join(
        f"{a}/{w} {e2e(a, w):.2f}" for a in ("static", "dynamic") for w in WEIGHTS), flush=True)  # fmt: skip
    print(f"{name}: end to end, dynamic activations, pc weights at amax·2^(k/8): " + ", ".join(
        f"k={k} {e2e('dynamic', float(k)):.2f}" for k in (0, 2, 4, 6)), flush=True)  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    from bench.harness import machine

    print(f"machine: {machine()[0]}; torch {torch.__version__}")
    for model_name in sys.argv[1:]:
        probe(model_name)
