"""Why fp16 O1 trails torch.autocast on MBConv / squeeze-excitation / separable-attention CNNs (issue 47).

Usage: ``python bench/bench_fold_fp16.py [--seeds 3]``

For the small models of ``tests/zoo_models.py`` with the culprits' structure (EfficientNet's MBConv with SiLU
and a sigmoid SE gate; the same with hard-swish as RepViT/MobileNetV3; MobileViTv2's separable attention),
random BatchNorm statistics, batch 8, 200 logits: the SQNR against FP32 of CPU ``torch.autocast`` on the
model, of autocast on the same model with every conv+BatchNorm fused (``fuse_conv_bn_eval``), and of amplite
O1 as it folds today (``affine after``: the user's conv low, the BatchNorm's ``y·scale + shift`` in FP32 after
it), with only the shift after the conv (the scale in the weight), with the whole fold in the conv (the shift
in its low bias, as O1 folded before issue 47) and without folding, and of O2 with the whole fold (its
default) and with the affine after the conv — side by side, per seed and precision, in one run, with the
casts each executes per forward. If "autocast on fused" equals "O1 (shift in bias)", that gap to autocast is
the folding, not amplite's precision plan.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import warnings
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval

import amplite
from amplite.converter import sequence
from amplite.passes.fold_batchnorm import FoldBatchNorm
from bench.autocast_count import accuracy, count_casts, run
from tests import zoo_models


def fused(model: torch.nn.Module) -> torch.nn.Module:
    """A copy with every Sequential(conv, BatchNorm, ...) fused as amplite folds it."""
    out = copy.deepcopy(model)
    for seq in out.modules():
        if isinstance(seq, torch.nn.Sequential) and len(seq) > 1 and isinstance(seq[0], torch.nn.Conv2d) \
                and isinstance(seq[1], torch.nn.BatchNorm2d):  # fmt: skip
            seq[0], seq[1] = fuse_conv_bn_eval(seq[0], seq[1]), torch.nn.Identity()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"{platform.machine()}, torch {torch.__version__}, 1 thread; SQNR (dB) against FP32\n")
    print("SQNR (dB), casts per forward in brackets\n")
    print("| model | precision | seed | autocast | autocast on fused | O1 (affine after) | O1 (shift after) "
          "| O1 (shift in bias) | O1 no-fold | O1 − autocast | O2 | O2 (affine after) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cls in (zoo_models.EfficientNetLike, zoo_models.RepViTLike, zoo_models.MobileViTv2Like):
        for precision in ("fp16", "bf16"):
            for seed in range(ns.seeds):
                torch.manual_seed(seed)
                model = cls().eval()
                model.fc = torch.nn.Linear(model.fc.in_features, 200)
                inputs = ((torch.randn(8, 3, 32, 32),), {})
                ref = run(model, inputs)

                def sqnr(out: object, ref: object = ref) -> float:
                    return accuracy(ref, out, logits=False)["sqnr_db"]

                ac, ac_fused = sqnr(run(model, inputs, precision)), sqnr(run(fused(model), inputs, precision))
                n_ac = count_casts(model, inputs, precision)["casts"]
                o1 = []
                for level, fold, split in (("O1", True, "affine"), ("O1", True, "shift"), ("O1", True, "full"),
                                           ("O1", False, "full"), ("O2", True, "full"), ("O2", True, "affine")):
                    # "full" at O1: the fold as O1 made it before issue 47, the shift rounded into the low bias
                    def make(mode: str = "full", split: str = split) -> FoldBatchNorm:
                        return FoldBatchNorm(split)  # whatever the level asks for

                    with mock.patch.object(sequence, "FoldBatchNorm", make):
                        mod = amplite.convert(model, inputs, precision=precision, level=level, verify=False,
                                              fold_batchnorm=fold).program.module()  # fmt: skip
                    o1.append(f"{sqnr(run(mod, inputs)):.2f} ({count_casts(mod, inputs)['casts']})")
                print(f"| {cls.__name__} | {precision} | {seed} | {ac:.2f} ({n_ac}) | {ac_fused:.2f} | "
                      f"{' | '.join(o1[:4])} | {float(o1[0].split()[0]) - ac:+.2f} | {' | '.join(o1[4:])} |",
                      flush=True)


if __name__ == "__main__":
    main()
