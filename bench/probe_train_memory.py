"""What ``prepare_training`` holds, measured stage by stage (issue 43 item 8), on bench_train_big's models.

Usage::

    python bench/probe_train_memory.py [--model gpt2] [--levels O1,O2]

One process per level. For each: the resident set (after ``gc`` and ``malloc_trim``, so memory the C
allocator merely caches is not counted) after importing amplite, after a first ``prepare_training`` of a
tiny model (torch.export's machinery loads lazily: a one-time cost of the process, not of the model), and
after preparing the model; then what the net holds, from its objects: tensor bytes outside the user's
parameters and buffers (graph attributes, low-precision copies), and the Python heap (``tracemalloc``) held
by the eval graph, by the train graph's node metadata and by the rest of the net, measured by dropping each.
Two processes per level (the resident set without ``tracemalloc``, then the heap with it); one JSON line each.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_train import _status_mb  # noqa: E402


def _rss() -> float:
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: the cached memory stays counted
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_mb("VmRSS")


def _heap() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def probe(model_name: str, level: str, heap: bool = False) -> dict[str, Any]:
    """The stage-by-stage figures of one level (MiB); with ``heap`` the Python-heap figures instead of the
    resident set after preparing (``tracemalloc``'s own bookkeeping would inflate that)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = _rss()
    import amplite
    from bench.bench_train_big import build

    imported = _rss()
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    amplite.prepare_training(tiny, torch.optim.AdamW(tiny.parameters()), (torch.randn(2, 8),), level=level)
    warmed = _rss()
    model, batches, _ = build(model_name, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    base = _rss()
    if heap:
        tracemalloc.start()
    net, opt = amplite.prepare_training(model, opt, (batches[0][0],), precision="bf16", level=level,
                                        dynamic_batch=False)  # fmt: skip
    held = _rss() - base
    user = {id(t) for t in (*model.parameters(), *model.buffers())}
    extra: dict[int, torch.Tensor] = {}
    variant = net._variants[0]
    for gm in (variant.train, variant.eval, variant.flat):
        for mod in gm.modules() if gm is not None else ():
            found = [*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()]
            extra.update({id(t): t for t in found if isinstance(t, torch.Tensor) and id(t) not in user})
    copies = sum(low.nbytes for _, low, _ in net._copies._copies.values() if low is not None)
    if not heap:
        return {"model": model_name, "level": level, "param_mib": sum(p.nbytes for p in model.parameters()) / 2**20,
                "import_amplite_mib": imported - start, "first_export_mib": warmed - imported,
                "held_after_prepare_mib": held, "graph_tensors_mib": sum(t.nbytes for t in extra.values()) / 2**20,
                "low_copies_mib": copies / 2**20}  # fmt: skip
    h0 = _heap()
    variant.eval = None
    h1 = _heap()
    for node in (variant.flat or variant.train).graph.nodes:
        node.meta.clear()
    h2 = _heap()
    del net, variant, opt
    h3 = _heap()
    mib = 2**20
    return {
        "model": model_name, "level": level, "py_heap_eval_graph_mib": (h0 - h1) / mib,
        "py_heap_train_meta_mib": (h1 - h2) / mib, "py_heap_rest_of_net_mib": (h2 - h3) / mib,
        "py_heap_left_in_torch_caches_mib": h3 / mib,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--levels", default="O1,O2")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        found = probe(args.one[0], args.one[1], heap=args.one[2] == "heap")
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in found.items()}))
        return
    for level, what in [(lvl, what) for lvl in args.levels.split(",") for what in ("rss", "heap")]:
        out = subprocess.run([sys.executable, __file__, "--one", args.model, level, what], capture_output=True,
                             text=True, cwd=ROOT)  # fmt: skip
        print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-500:], flush=True)


if __name__ == "__main__":
    main()
