"""Zoo sweep: timm and torchvision models (random init, CPU), each converted at fp16/bf16 × O1/O2 against
torch.autocast on the same inputs, and the ``.pt2`` amplite wrote read back.

Usage (the zoo venv: ``make zoo-venv``, then)::

    ZOO_VENV/bin/python bench/bench_zoo.py [--only resnet18,eva02_tiny] [--json bench/results-zoo.json]
        [--md FILE] [--write]

torchvision needs the torch build it was released with, so the sweep runs in its own venv (the ``zoo`` extra,
``make zoo-venv``), never in ``make test``. Each row is :func:`bench.bench_breadth.measure` (exportable?,
autocast's SQNR, each configuration's outcome and SQNR against FP32), plus whether amplite reads back the bf16
O1 ``.pt2`` it wrote (``amplite inspect`` on it). The machine is shared: one thread, a deadline per model.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import warnings
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import amplite
from amplite.describe import summarize_exception
from bench.bench_breadth import _deadline, markdown, measure
from bench.breadth_corpus import Arch

TIMEOUT_S = 1200


def _tv(name: str, shape: tuple[int, ...], **kw: Any) -> Any:
    def build() -> tuple[torch.nn.Module, Any]:
        import torchvision

        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, **kw).eval()
        return model, ((torch.randn(*shape),), {})

    return build


def _timm(name: str, shape: tuple[int, ...], **kw: Any) -> Any:
    def build() -> tuple[torch.nn.Module, Any]:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, **kw).eval()
        return model, ((torch.randn(*shape),), {})

    return build


IMG = (2, 3, 128, 128)
IMG224 = (2, 3, 224, 224)
#: One model per family, small inputs where the model allows (the sweep runs on one shared CPU core).
ZOO = [
    Arch("resnet18", "torchvision CNN", _tv("resnet18", IMG)),
    Arch("regnet_y_400mf", "torchvision RegNet (block1-0 names)", _tv("regnet_y_400mf", IMG)),
    Arch("efficientnet_b0", "torchvision MBConv + SE", _tv("efficientnet_b0", IMG)),
    Arch("mobilenet_v3_small", "torchvision hard-swish + SE", _tv("mobilenet_v3_small", IMG)),
    Arch("convnext_tiny", "torchvision ConvNeXt (layer scale)", _tv("convnext_tiny", IMG)),
    Arch("swin_t", "torchvision Swin", _tv("swin_t", IMG224)),
    Arch("shufflenet_v2_x0_5", "torchvision ShuffleNet", _tv("shufflenet_v2_x0_5", IMG)),
    Arch("eva02_tiny", "timm EVA-02 (RoPE, SwiGLU)", _timm("eva02_tiny_patch14_224", IMG224)),
    Arch("repvit_m1", "timm RepViT", _timm("repvit_m1", IMG)),
    Arch("mobilevitv2_050", "timm MobileViTv2 (separable attention)", _timm("mobilevitv2_050", IMG)),
    Arch("deit_tiny", "timm ViT", _timm("deit_tiny_patch16_224", IMG224)),
    Arch("convnext_atto", "timm ConvNeXt", _timm("convnext_atto", IMG)),
    Arch("levit_128s", "timm LeViT (attention bias)", _timm("levit_128s", IMG224)),
    Arch("poolformer_s12", "timm MetaFormer", _timm("poolformer_s12", IMG)),
    Arch("mvit_v2_s", "torchvision MViT (pooling attention, video)", _tv("mvit_v2_s", (1, 3, 16, 224, 224))),
]
BY_NAME = {a.name: a for a in ZOO}


def read_back(arch: Arch) -> str:
    """Whether amplite reads back the bf16 O1 ``.pt2`` it wrote for this model ("ok" or the one-line error)."""
    model, inputs = arch.build()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.pt2"
        try:
            amplite.convert(model, inputs, precision="bf16", level="O1", verify=False).save(path)
            amplite.convert(path, precision="bf16", level="O1", verify=False)
        except Exception as exc:
            return summarize_exception(exc)[:300]
    return "ok"


def machine() -> str:
    """What the sweep ran on, read off the machine."""
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), torch "
            f"{torch.__version__}, Python {platform.python_version()}")  # fmt: skip


def _commit() -> str:
    """The commit of the amplite code measured (with '+' when the work tree differs from it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "amplite"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model names (merged into --json; '' only rewrites)")
    parser.add_argument("--json", type=Path, default=Path("bench/results-zoo.json"))
    parser.add_argument("--md", type=Path, help="write the table (and the machine it ran on) to this file")
    parser.add_argument("--write", action="store_true", help="put the table into bench/RESULTS.md (Model zoo)")
    parser.add_argument("--draws", type=int, default=4,
                        help="input draws the O1 criterion is judged on, pooled (the example + N-1 more; default 4): "
                             "one draw's O1 − autocast spreads by 0.3-0.9 dB, more than the 0.5 dB margin")
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # --only '' measures nothing and only rewrites the table from --json
    names = [n for n in ns.only.split(",") if n] if ns.only is not None else [a.name for a in ZOO]
    old = {r["name"]: r for r in json.loads(ns.json.read_text())} if ns.json.exists() else {}
    for name in names:
        arch, start = BY_NAME[name], perf_counter()
        try:
            with _deadline(TIMEOUT_S):
                row = measure(arch, draws=ns.draws)
                if row.get("exportable"):
                    row["read_back"] = read_back(arch)
        except Exception as exc:
            row = {"name": name, "family": arch.family, "exportable": True, "error": summarize_exception(exc)[:300]}
        row["sweep_seconds"] = round(perf_counter() - start, 1)
        row["machine"] = machine()
        row["amplite_commit"] = _commit()
        old[name] = row
        print(name, json.dumps(row, default=str)[:600], flush=True)
        ns.json.write_text(json.dumps([old[a.name] for a in ZOO if a.name in old], indent=1) + "\n")
    rows = [old[a.name] for a in ZOO if a.name in old]
    if ns.md:
        ns.md.write_text(section(rows))
    if ns.write:
        results = Path(__file__).resolve().parent / "RESULTS.md"
        text, begin, end = results.read_text(), "<!-- zoo:begin -->", "<!-- zoo:end -->"
        if begin not in text:
            text += f"\n## Model zoo: timm and torchvision (bench/bench_zoo.py)\n\n{begin}\n{end}\n"
        head, _, rest = text.partition(begin)
        results.write_text(head + begin + "\n" + section(rows) + end + rest.partition(end)[2])


def section(rows: list[dict[str, Any]]) -> str:
    """The table, what it ran on and at which amplite commit, and whether every written .pt2 read back."""
    back = [f"- {r['name']}: {r['read_back']}" for r in rows if r.get("read_back", "ok") != "ok"]
    commits = sorted({r.get("amplite_commit", "?") for r in rows})
    missing = [a.name for a in ZOO if a.name not in {r["name"] for r in rows}]
    return (f"Measured on {rows[0]['machine'] if rows else machine()}, amplite {', '.join(commits)}; "
            "random init, batch 2, 128 px (224 for the ViTs and Swin), one thread.\n\n" + markdown(rows)
            + "\nEvery .pt2 amplite wrote (bf16 O1) read back by amplite: "
            + (("\n" + "\n".join(back)) if back else "all ok") + "\n"
            + (f"\nNot measured in this run (the sweep is slow on a shared CPU): {', '.join(missing)}.\n"
               if missing else ""))  # fmt: skip


if __name__ == "__main__":
    main()
