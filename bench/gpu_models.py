"""End-to-end part of ``bench/gpu_suite.py``: the models, the precision variants and their measurement.

Each model is exported once in FP32 with a dynamic batch (else once per batch size) and run through
amplite's passes at O1/O2 in fp16/bf16, with and without contraction fusion (see :func:`_rewrite`).
Eager baselines: FP32 with TF32 off and on, ``torch.autocast`` fp16/bf16.
Latency is the median of CUDA-event timings (wall clock on CPU, for ``--dry-run``); peak memory is the
allocator's peak during one forward, above what was allocated before it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

import amplite
from amplite.converter.tracing import export_model
from bench.autocast_count import accuracy
from bench.gpu_contract import Block, timeit

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
LEVELS = ("O1", "O2")
PRECISIONS = ("fp16", "bf16")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CONTRACT = torch.ops.amplite.contract.default


@dataclass(frozen=True)
class ModelSpec:
    """A model of the suite: name, builder, whether it is a transformer (the latency targets apply)."""

    name: str
    build: Callable[[], tuple[nn.Module, Inputs]]
    transformer: bool = True


class TinyCNN(nn.Module):
    """A conv-BN-ReLU net standing in for ResNet-50 in ``--dry-run``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 10)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(pixel_values).flatten(1))


def _tiny_block() -> tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    return Block(32, 2).eval(), ((torch.randn(2, 8, 32),), {})


def _tiny_cnn() -> tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    return TinyCNN().eval(), ((torch.randn(1, 3, 16, 16),), {})


def specs(dry: bool) -> list[ModelSpec]:
    """The suite's models: the issue's six (GPT-2 as prefill and as one decode step), or two tiny stand-ins."""
    if dry:  # one transformer block runs every code path; TinyCNN is there for trying a CNN by hand
        return [ModelSpec("tiny-block", _tiny_block)]
    from bench import corpus

    return [
        ModelSpec("bert-base", corpus.bert_base),
        ModelSpec("gpt2-prefill", corpus.gpt2),
        ModelSpec("gpt2-decode", corpus.gpt2_kv),
        ModelSpec("vit-b16", corpus.vit_b16),
        ModelSpec("resnet50", corpus.resnet50, transformer=False),
        ModelSpec("whisper-tiny", corpus.whisper_tiny),
        ModelSpec("t5-small", corpus.t5_small),
    ]


def rebatch(inputs: Inputs, n: int, device: torch.device) -> Inputs:
    """The example inputs with batch size ``n`` (row 0 repeated; caches too), on ``device``."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x[:1].repeat(n, *([1] * (x.dim() - 1))).to(device)
        return x

    return pytree.tree_map(one, inputs)


def call(model: Any, inputs: Inputs) -> Any:
    args, kwargs = inputs
    with torch.no_grad():
        return model(*args, **kwargs)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls/convolutions on or off for the block (restored after)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """Median ms and peak memory (MiB above the allocation before the call) of ``fn``."""
    peak = math.nan
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"ms": timeit(fn, device, warmup, iters), "peak_mib": peak}


def _eager_variants(model: nn.Module, device: torch.device) -> list[tuple[str, Callable, Any]]:
    """(label, runner, context factory) for the eager baselines."""
    rows: list[tuple[str, Callable, Any]] = [
        ("fp32 (TF32 off)", model, lambda: tf32(False)),
        ("fp32 (TF32 on)", model, lambda: tf32(True)),
    ]
    for p in PRECISIONS:
        rows.append((f"autocast {p}", model, lambda p=p: torch.autocast(device.type, dtype=DTYPES[p])))
    return rows


def export_fp32(model: nn.Module, inputs: Inputs, dynamic: bool) -> torch.export.ExportedProgram:
    """FP32 program; with ``dynamic``, dim 0 of every tensor input is one batch dimension of size >= 1."""
    if not dynamic:
        return export_model(model, inputs)
    batch = Dim("batch", min=1, max=4096)
    args, kwargs = inputs
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    shapes = {k: _batch_shapes(v, batch) for k, v in bound.items()}
    return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)


def _batch_shapes(x: Any, batch: Any) -> Any:
    """``dynamic_shapes`` for one input: dim 0 of each tensor is ``batch``. A registered pytree class (a
    ``DynamicCache``) is described by its flattened children, as torch.export expects."""
    if isinstance(x, torch.Tensor):
        return {0: batch} if x.dim() > 0 else None
    if type(x) in (list, tuple):
        return type(x)(_batch_shapes(v, batch) for v in x)
    if type(x) is dict:
        return {k: _batch_shapes(v, batch) for k, v in x.items()}
    node = pytree.SUPPORTED_NODES.get(type(x))
    return None if node is None else _batch_shapes(list(node.flatten_fn(x)[0]), batch)


def _rewrite(program: Any, inputs: Inputs, precision: str, level: str, fuse: bool, ranges: Any = None) -> Any:
    """amplite's passes on ``program`` as ``amplite.convert`` runs them, without the final re-export.

    The saved ``.pt2`` is this graph re-exported; running the GraphModule times the same kernels and lets
    one dynamic-batch conversion serve batch 1 and 32 (a re-export with ``Dim.AUTO`` would refuse batch 1).
    ``ranges`` (from the unfused variant's rewrite) skips a second calibration. Returns the Rewrite (its
    ``module`` and ``ranges``), or falls back to ``amplite.convert`` (static; a ``SimpleNamespace`` with
    ``module``) where the pipeline's internals are not importable.
    """
    try:
        from amplite.converter.pipeline import rewrite
        from amplite.spec import ConvertSpec
    except ImportError:
        res = amplite.convert(program, inputs, precision=precision, level=level, verify=False,
                              fuse_contractions="on" if fuse else "off")  # fmt: skip
        return types.SimpleNamespace(module=res.program.module(), ranges=None)
    spec = ConvertSpec.build(precision=precision, level=level, fuse_contractions=fuse, range_rules=True)
    return rewrite(program, inputs, spec, ranges=ranges)


def variants(dry: bool) -> list[tuple[str, str]]:
    """(level, precision) pairs converted: all four, or in a dry run two that cover both levels and dtypes."""
    return [("O1", "fp16"), ("O2", "bf16")] if dry else [(lv, p) for lv in LEVELS for p in PRECISIONS]


def convert_all(
    spec: ModelSpec, model: nn.Module, inputs: Inputs, dynamic: bool, dry: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every amplite variant of ``model``: ``({label: module or the exception}, notes)``."""
    notes: list[dict[str, Any]] = []
    program = export_fp32(model, inputs, dynamic)
    modules: dict[str, Any] = {}
    for level, p in variants(dry):
        ranges = None
        for fuse in (False, True):
            label = f"amplite {level} {p}" + (" + fusion" if fuse else "")
            try:
                t0 = time.perf_counter()
                done = _rewrite(program, inputs, p, level, fuse, ranges)
                gm, ranges = done.module, done.ranges
                modules[label] = gm
                n = sum(1 for node in gm.graph.nodes if node.target is CONTRACT)
                notes.append({"model": spec.name, "variant": label, "convert_s": time.perf_counter() - t0,
                              "contract_nodes": n})  # fmt: skip
            except Exception as e:
                modules[label] = e
    return modules, notes


def run_model(
    spec: ModelSpec, batches: tuple[int, ...], device: torch.device, warmup: int, iters: int, dry: bool,
    lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows ``{model, batch, variant, ms, peak_mib, sqnr_db, error}`` for one model, and conversion notes.

    The measurements run inside ``lock()`` (the suite's GPU lock: no other job times meanwhile)."""
    model, example = spec.build()
    model = model.to(device)
    rows: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    try:  # one dynamic-batch conversion (traced at batch 2: no 0/1 specialisation) serves every batch
        converted, notes = convert_all(spec, model, rebatch(example, 2, device), dynamic=True, dry=dry)
        dynamic = True
    except Exception as e:
        notes.append({"model": spec.name, "note": f"dynamic-batch export failed ({type(e).__name__}): per batch"})
        converted, dynamic = {}, False
    with lock():
        rows += _measure_batches(spec, model, example, converted, dynamic, batches, device, warmup, iters, dry, notes)
    return rows, notes


def _measure_batches(spec: ModelSpec, model: nn.Module, example: Inputs, converted: dict[str, Any], dynamic: bool,
                     batches: tuple[int, ...], device: torch.device, warmup: int, iters: int, dry: bool,
                     notes: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    for batch in batches:
        inputs = rebatch(example, batch, device)
        with tf32(False):
            reference = call(model, inputs)
        if not dynamic:
            converted, more = convert_all(spec, model, inputs, dynamic=False, dry=dry)
            notes += more
        variants: list[tuple[str, Any, Any]] = _eager_variants(model, device)
        variants += [(k, m, contextlib.nullcontext) for k, m in converted.items()]
        for label, runner, ctx in variants:
            row: dict[str, Any] = {"model": spec.name, "batch": batch, "variant": label}
            if isinstance(runner, Exception):
                rows.append(row | {"error": f"{type(runner).__name__}: {str(runner).splitlines()[0][:200]}"})
                continue
            try:
                with ctx():
                    out = call(runner, inputs)
                    row |= measure(lambda r=runner, i=inputs: call(r, i), device, warmup, iters)
                row["sqnr_db"] = accuracy(reference, out, logits=False).get("sqnr_db", math.nan)
            except Exception as e:  # one failing variant must not hide the others
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rows.append(row)
    return rows
