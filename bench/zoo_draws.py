"""Is a zoo row's O1-below-autocast miss a rule or the draw? O1 − autocast per input draw and per model seed.

Usage (the zoo venv, ``make zoo-venv``)::

    ZOO_VENV/bin/python bench/zoo_draws.py convnext_atto --precision bf16 --draws 0-11 [--batch 8]
    ZOO_VENV/bin/python bench/zoo_draws.py mvit_v2_s --precision fp16 --seeds 0-3 [--tokens]

``bench/bench_zoo.py`` scores each model on one input (``torch.manual_seed(0)``, the model, then
``torch.randn``): one draw of the input and one of the random weights. This prints, for each model seed and
input draw (draw 0 is the bench's input; draw ``d`` > 0 is ``torch.randn`` from a generator seeded ``d``),
the SQNR against FP32 of CPU ``torch.autocast`` and of amplite's O1 on the same inputs, their difference,
and the mean difference. ``--tokens`` (mvit_v2_s only) also scores the tokens after the final norm and the
class token alone (the head reads only that token). One thread; no pins, verification off.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import amplite
from bench.autocast_count import run
from bench.bench_zoo import IMG, IMG224, _commit

#: The bench's input shapes (bench/bench_zoo.py), by model.
SHAPES = {"mvit_v2_s": (1, 3, 16, 224, 224), "deit_tiny": IMG224, "swin_t": IMG224}


def build(name: str, seed: int) -> torch.nn.Module:
    """The zoo model ``name`` at random init from ``torch.manual_seed(seed)`` (seed 0: the bench's model)."""
    torch.manual_seed(seed)
    try:
        import torchvision

        return torchvision.models.get_model(name, weights=None).eval()
    except ValueError:  # not a torchvision model name
        import timm

        return timm.create_model(name, pretrained=False).eval()


class MViTTokens(torch.nn.Module):
    """torchvision's MViT returning the tokens after its final norm and the logits (its own forward's steps)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.m
        x = m.pos_encoding(m.conv_proj(x).flatten(2).transpose(1, 2))
        thw = (m.pos_encoding.temporal_size, *m.pos_encoding.spatial_size)
        for block in m.blocks:
            x, thw = block(x, thw)
        tokens = m.norm(x)
        return tokens, m.head(tokens[:, 0])


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``20·log10(‖ref‖/‖ref − out‖)`` in float64."""
    ref, out = ref.double(), out.double()
    return 20 * math.log10(float(ref.norm()) / float((ref - out).norm()))


def parts(out: Any, tokens: bool) -> dict[str, torch.Tensor]:
    """The scored outputs: the logits, and with ``tokens`` the normed tokens and the class token."""
    if not tokens:
        return {"logits": out}
    return {"logits": out[1], "tokens": out[0], "class token": out[0][:, 0]}


def _ints(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(t) for t in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a bench/bench_zoo.py model name (torchvision or timm)")
    parser.add_argument("--precision", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--draws", default="0", help="input draws: '0-11' or '0,3' (0: the bench's input)")
    parser.add_argument("--seeds", default="0", help="model seeds: '0-3' or '0,2' (0: the bench's model)")
    parser.add_argument("--batch", type=int, help="batch size (default: the bench's)")
    parser.add_argument("--tokens", action="store_true", help="mvit_v2_s: also score the tokens and class token")
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    shape = SHAPES.get(ns.model, IMG)
    shape = (ns.batch or shape[0], *shape[1:])
    print(f"{ns.model} {ns.precision} O1, input {shape}; {platform.machine()}, 1 thread, torch {torch.__version__}, "
          f"amplite {_commit()}\n")  # fmt: skip
    print("| model seed | input draw | output | autocast (dB) | O1 (dB) | O1 − autocast |\n|---|---|---|---|---|---|")
    diffs: dict[str, list[float]] = {}
    for seed in _ints(ns.seeds):
        model = build(ns.model, seed)
        first = torch.randn(*shape)  # the bench draws its input right after building the model
        net = MViTTokens(model).eval() if ns.tokens else model
        for draw in _ints(ns.draws):
            x = first if draw == 0 else torch.randn(*shape, generator=torch.Generator().manual_seed(draw))
            inputs = ((x,), {})
            ref, auto = parts(run(net, inputs), ns.tokens), parts(run(net, inputs, autocast=ns.precision), ns.tokens)
            result = amplite.convert(net, inputs, precision=ns.precision, level="O1", verify=False)
            o1 = parts(run(result.program.module(), inputs), ns.tokens)
            for key in ref:
                a, b = sqnr(ref[key], auto[key]), sqnr(ref[key], o1[key])
                diffs.setdefault(key, []).append(b - a)
                print(f"| {seed} | {draw} | {key} | {a:.2f} | {b:.2f} | {b - a:+.2f} |", flush=True)
    print()
    for key, values in diffs.items():
        spread = f", sd {statistics.stdev(values):.2f}" if len(values) > 1 else ""
        print(f"{key}: O1 − autocast mean {statistics.mean(values):+.2f} dB over {len(values)}{spread}, "
              f"min {min(values):+.2f}, max {max(values):+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
