"""fx-mlp O2: torch.compile(ep.module()) vs ep.module().compile() vs the bare graph, and what each rejects (issue 31).

    python bench/probe_inplace_compile.py
"""

# ruff: noqa
import os, statistics, sys, time, warnings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")
import torch, amplite
from bench.bench_compiled import MODELS
torch.set_num_threads(1)
print("load", os.getloadavg())
model, (args, kwargs) = MODELS["fx-mlp"]()
res = amplite.convert(model, (args, kwargs), precision="bf16", level="O2", verify=False)
with torch.no_grad():
    a = torch.compile(res.module())
    b = res.module(); b.compile()
    bare = res.program.module(check_guards=False); bare.validate_inputs = False
    c = torch.compile(bare)
    runs = {"torch.compile(ep.module())": a, "ep.module().compile()": b, "torch.compile(bare graph)": c}
    for f in runs.values():
        f(*args); f(*args)
    s = {k: [] for k in runs}
    for _ in range(5):
        for k, f in runs.items():
            t = time.perf_counter()
            for _ in range(300):
                f(*args)
            s[k].append((time.perf_counter() - t) / 300 * 1e3)
    for k, v in s.items():
        print(f"{k:30s} median {statistics.median(v):.3f} ms  {[round(x, 3) for x in v]}")
    for k, f in runs.items():
        try:
            f(torch.randn(4, 33))
            print(k, "wrong shape (4,33): ACCEPTED")
        except Exception as e:
            print(k, "wrong shape (4,33): rejected:", type(e).__name__, str(e).split("\n")[0][:150])
        try:
            f(args[0].double())
            print(k, "wrong dtype float64: ACCEPTED")
        except Exception as e:
            print(k, "wrong dtype float64: rejected:", type(e).__name__, str(e).split("\n")[0][:150])
print("load", os.getloadavg())
