"""Decode at batch 1: what one decode step executes, counted on the CPU (issue 41).

Counts, per decode step of a tiny GPT-2-shaped model with a KV cache (the converted LLM step program's
signature, ``amplite.llm.step``), for each variant: aten ops, casts (``_to_copy``), copies of the KV cache
(``cat``/``stack``/``index_copy``/``clone``/``copy_`` whose result is as large as a cache layer), host syncs
(``item``/``_local_scalar_dense``/``nonzero``), and the exported module's per-call input checks (calls of
its pre-hook). Variants: the FP32 step, the all-bf16 model (``model.to(bfloat16)``, bf16 cache), autocast
bf16 over the FP32 step, and amplite O1/O2 (``amplite.llm.convert_llm``, bf16). The counts do not depend on
the device, which is why they can be taken here; the GPU's per-kernel launch cost turns them into time.

``python bench/decode_count.py`` prints the table (markdown) recorded in bench/RESULTS-gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CASTS = ("_to_copy",)
COPIES = ("cat", "stack", "index_copy", "index_copy_", "clone", "copy_", "slice_scatter", "index_put")
SYNCS = ("item", "_local_scalar_dense", "nonzero")
VARIANTS = ("fp32", "all-bf16", "autocast-bf16", "amplite-O1", "amplite-O2")


class StepCounter(TorchDispatchMode):
    """Counts aten ops by name, and copies whose result holds at least ``cache_numel`` elements."""

    def __init__(self, cache_numel: int) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0  # ops that compute (not views/aliases): what a GPU launches kernels for
        self.cache_copies: Counter[str] = Counter()
        self.cache_copy_bytes = 0
        self.cache_numel = cache_numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.kernels += not func.is_view
        if name in COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.cache_numel:
            self.cache_copies[name] += 1
            self.cache_copy_bytes += out.numel() * out.element_size()
        return out

    def summary(self) -> dict[str, int]:
        """The per-step figures the table and the tests use."""
        return {
            "aten_ops": sum(self.ops.values()),
            "kernel_ops": self.kernels,
            "norms": sum(n for op, n in self.ops.items() if "norm" in op),
            "casts": sum(self.ops[n] for n in CASTS),
            "cache_copies": sum(self.cache_copies.values()),
            "cache_copy_kib": self.cache_copy_bytes // 1024,
            "syncs": sum(self.ops[n] for n in SYNCS),
        }


def tiny_gpt2(layers: int = 2, d: int = 64, heads: int = 4, vocab: int = 256) -> torch.nn.Module:
    """A GPT-2-shaped causal LM small enough to convert in seconds (same op mix per layer as GPT-2 124 M)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=d, n_layer=layers, n_head=heads)
    return transformers.GPT2LMHeadModel(cfg).eval()


@contextlib.contextmanager
def count_input_checks() -> Iterator[list[int]]:
    """Counts the exported module's per-call input checks (``_check_inputs_match``, which its pre-forward
    hook calls on every call unless ``validate_inputs`` is off), one list entry per call."""
    import torch.export._unlift as unlift

    calls: list[int] = []
    real = getattr(unlift, "_check_inputs_match", None)
    if real is None:  # another torch layout: nothing to count
        yield calls
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    unlift._check_inputs_match = counted
    try:
        yield calls
    finally:
        unlift._check_inputs_match = real


def steps(
    model: torch.nn.Module, variants: tuple[str, ...] = VARIANTS, device: str = "cpu"
) -> dict[str, tuple[Callable, torch.dtype]]:
    """Each variant's step callable (LMStep signature) and its cache dtype; ``model`` is on ``device``."""
    import copy

    from amplite.llm import convert_llm
    from amplite.llm.step import LMStep, amplite_attention

    out: dict[str, tuple[Callable, torch.dtype]] = {}
    for v in variants:
        if v == "fp32":
            out[v] = (_with_attention(LMStep(model, torch.float32), amplite_attention, model), torch.float32)
        elif v == "all-bf16":
            low = copy.deepcopy(model).to(torch.bfloat16)
            out[v] = (_with_attention(LMStep(low, torch.bfloat16), amplite_attention, low), torch.bfloat16)
        elif v == "autocast-bf16":
            inner = _with_attention(LMStep(model, torch.float32), amplite_attention, model)

            def auto(*a: Any, _inner: Callable = inner) -> Any:
                with torch.autocast(device, dtype=torch.bfloat16):
                    return _inner(*a)

            out[v] = (auto, torch.float32)
        else:
            result = convert_llm(model, precision="bf16", level=v.split("-")[1], verify=False)
            out[v] = (result.llm.runner().step, result.llm.cache_dtype)  # what generate() runs
    return out


def _module_of(model: torch.nn.Module) -> Callable:
    """O2's program as ``LLMProgram.module()`` gives it (torch's input check on), for the comparison."""
    from amplite.llm import convert_llm

    return convert_llm(model, precision="bf16", level="O2", verify=False).llm.module()


def _with_attention(step: torch.nn.Module, ctx: Callable, model: torch.nn.Module) -> Callable:
    def run(*a: Any) -> Any:
        with ctx(model):
            return step(*a)

    return run


def count_decode(
    step: Callable, shape: Any, cache_dtype: torch.dtype, batch: int = 1, past: int = 16, vocab: int = 256
) -> dict[str, int]:
    """The figures of one decode step (batch ``batch``, ``past + 1`` cached tokens) as ``generate()`` runs it
    (:class:`amplite.llm.generate.Runner`: the step, then the runner writing its new tokens into the cache),
    after a warm-up step."""
    from amplite.llm.generate import Runner

    runner = Runner(step, shape, cache_dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, past), generator=g)
    with torch.no_grad():
        logits, keys, values = runner.prefill(ids, torch.ones(batch, past, dtype=torch.long), past + 2)
        token = logits[:, -1].argmax(-1)
        mask = torch.ones(batch, past + 1, dtype=torch.long, device=runner.device)
        logits, keys, values = runner.decode(token, mask, keys, values)  # warm-up: first-call work is not per-step
        token, mask = logits[:, -1].argmax(-1), torch.ones(batch, past + 2, dtype=torch.long, device=runner.device)
        counter = StepCounter(cache_numel=int(keys[0].numel()))
        with count_input_checks() as checks, counter:
            runner.decode(token, mask, keys, values)
    return {**counter.summary(), "input_checks": len(checks)}


def table(rows: dict[str, dict[str, int]]) -> str:
    cols = ("aten_ops", "kernel_ops", "casts", "norms", "cache_copies", "cache_copy_kib", "syncs", "input_checks")
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {v} | " + " | ".join(str(r[c]) for c in cols) + " |" for v, r in rows.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    args = p.parse_args(argv)
    from amplite.llm.step import cache_shape

    model = tiny_gpt2(args.layers)
    shape = cache_shape(model)
    made = steps(model)
    made["amplite-O2 module()"] = (_module_of(model), torch.bfloat16)
    print(f"torch {torch.__version__}, {platform.machine()}, GPT-2 shaped: {args.layers} layers, d 64, 4 heads")
    for b in args.batch:
        print(f"\nbatch {b}, one decode step after 17 cached tokens:\n")
        print(table({v: count_decode(fn, shape, dt, batch=b) for v, (fn, dt) in made.items()}))


if __name__ == "__main__":
    main()
