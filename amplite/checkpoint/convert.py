"""Convert a transformers checkpoint directory without materialising it.

The plan needs only the graph and the weights' metadata: the model is built from ``config.json`` with
meta parameters, exported on meta example inputs, and run through amplite's passes (no calibration: the
activation range rules need a forward with real weights; for fp16 the weight rules run on statistics
streamed from the shards, one tensor at a time). The result (:class:`~amplite.checkpoint.result.
StreamedConversion`, re-exported here) writes the outputs by streaming each weight from its shard, cast to
its planned dtype (``amplite.checkpoint.write``).
"""

from __future__ import annotations

import math
import resource
from dataclasses import replace
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.checkpoint.example_inputs import on_meta, random_inputs
from amplite.checkpoint.fp8 import calibrate, fp8_section, plan_fp8, refuse_quantized, split_fp8
from amplite.checkpoint.keys import KeyMap, map_keys
from amplite.checkpoint.model import build_meta_model
from amplite.checkpoint.result import Progress, StreamedConversion, _no_progress
from amplite.checkpoint.source import (
    PREFIX,
    Checkpoint,
    example_inputs_for,
    iter_shard,
    load_tensor,
    open_checkpoint,
)
from amplite.checkpoint.untraced import planned_dtypes
from amplite.converter.graph_stats import graph_stats
from amplite.converter.pipeline import PipelineOutput, run_pipeline
from amplite.errors import ExportError
from amplite.options import ConvertOptions
from amplite.passes.range_guard import RangeRules, weight_reason
from amplite.policy import Level, make_overrides
from amplite.report.document import build_report
from amplite.report.sections import Source, WeightRules
from amplite.spec import RangeSpec
from amplite.verify.data import calibration_batches

__all__ = ["Progress", "StreamedConversion", "_no_progress", "convert_checkpoint", "on_meta", "random_inputs"]

def weight_rules(ckpt: Checkpoint, keys: KeyMap, progress: Progress, rules: RangeRules) -> dict[str, str]:
    """fp16 weight rules on streamed statistics: module path -> reason, for weights fp16 cannot hold.

    The rule of ``amplite.passes.range_guard`` (:func:`~amplite.passes.range_guard.weight_reason`): a weight
    with |w| above 65504 (``range:weight-overflow``), or whose non-zero values mostly flush to zero in fp16
    (``range:weight-underflow``), keeps its module in FP32. Each tensor is read once, without a copy.
    """
    flagged: dict[str, str] = {}
    targets = keys.shard_targets()
    total, done = ckpt.total_bytes, 0
    for shard in ckpt.shards:
        for name, t in iter_shard(shard):
            done += t.nbytes
            progress("reading weight statistics", done, total)
            reason = weight_reason(t, rules)
            if reason is not None and name in targets:
                flagged[PREFIX + targets[name].rsplit(".", 1)[0]] = reason
            del t
    return flagged


def convert_checkpoint(
    path: str | Path,
    example_inputs: Any = None,
    *,
    options: ConvertOptions | None = None,
    progress: Progress = _no_progress,
    **changes: Any,
) -> StreamedConversion:
    """Plan the conversion of a checkpoint directory from its config and weight metadata.

    Args:
        path: A directory with ``config.json`` and sharded (or single) ``*.safetensors``.
        example_inputs: ``(args, kwargs)`` for tracing (default: ``input_ids`` of shape (1, 8)); moved to meta.
        options: The conversion options; those a streamed directory uses are precision, level, keep_fp32,
            force_low, low_precision_io and range_rules (the fp16 weight rules on streamed statistics, None: at
            O1/O2); verify and tolerance apply to its verification. Any other option given is refused.
            ``precision="fp8"``: the bf16 plan, with the decoder blocks' linear weights stored FP8 (vLLM's
            layout, :mod:`amplite.checkpoint.fp8`); ``calibration`` then gives static activation scales.
        progress: Called as ``(step, bytes done, bytes total)`` while reading shards.
        **changes: Options by name, over ``options`` (as for :func:`amplite.convert`).

    Returns:
        The planned conversion; ``save_safetensors`` / ``save_pt2`` write it by streaming.

    Raises:
        ConfigError: An option that does not apply to a checkpoint directory, or a bad value.
    """
    full = ConvertOptions.of(options, **changes)
    split_fp8(full)[0].only_for("checkpoint")  # before any work (fp8's calibration feeds its scales)
    # fp8: the bf16 plan, with FP8 weights planned by amplite.checkpoint.fp8 (static scales from calibration)
    spec = full.spec("checkpoint", module_prefix=PREFIX)
    fp8 = spec.fp8 is not None
    batches = calibration_batches(full.calibration) if fp8 and full.calibration is not None else None
    lvl = spec.level
    timings: dict[str, float] = {}
    start = perf_counter()
    ckpt = open_checkpoint(path)
    refuse_quantized(ckpt)
    model, buffers = build_meta_model(ckpt)
    keys = map_keys(ckpt, model.lm)
    plan = plan_fp8(keys, model.lm) if fp8 else None  # refuses what it cannot store, before export
    if example_inputs is None and batches:
        example_inputs = batches[0]  # calibration runs the traced program: trace with its shapes
    inputs = example_inputs if example_inputs is not None else example_inputs_for(ckpt.config)
    inputs = torch.utils._pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, inputs)
    timings["build"] = perf_counter() - start
    start = perf_counter()
    rules = spec.range_rules()  # fp16 weight rules only: bf16 holds FP32's range
    flagged = weight_rules(ckpt, keys, progress, rules) if rules is not None and spec.precision is torch.float16 else {}
    timings["weight_statistics"] = perf_counter() - start
    # fp16 weight rules; patterns see the user's module names (model.layers.0...), not the wrapper's lm.
    pins = make_overrides([f"module:{m.removeprefix(PREFIX)}" for m in flagged], source="checkpoint")
    # The activation range rules need a forward with real weights: the meta trace runs none. FP8 is planned
    # on the shards by amplite.checkpoint.fp8, over the bf16 plan.
    planned = replace(spec.with_overrides(pins), ranges=RangeSpec(enabled=False), fp8=None)
    untraced: str | None = None
    try:
        out: PipelineOutput | None = run_pipeline(model, inputs, planned)
        timings.update(out.timings)
        _check_constants(out.converted, keys, buffers)
        dtypes = {name: t.dtype for name, t in [*out.converted.state_dict.items(), *out.converted.constants.items()]
                  if isinstance(t, torch.Tensor)}  # fmt: skip
    except ExportError as exc:  # the safetensors output needs no trace (amplite.checkpoint.untraced)
        if plan is not None:  # FP8's static scales and its checks run the traced program
            raise
        out, untraced = None, exc.problem
        dtypes = planned_dtypes(keys, spec.precision, lvl, flagged)
    if plan is not None and batches is not None and out is not None:
        start = perf_counter()
        plan = calibrate(plan, out.original, lambda n: _fp32_tensor(ckpt, keys, buffers, n), batches)
        timings["fp8_calibration"] = perf_counter() - start
    dtypes.update(storage_dtypes(ckpt, keys, dtypes))
    if plan is not None:
        dtypes.update(dict.fromkeys(plan.linears, torch.float8_e4m3fn))
    after = sum(math.prod(i.shape) * dtypes[n].itemsize for n, i in ckpt.tensors.items())
    applied = rules is not None
    warnings = storage_warnings(ckpt, keys, dtypes, lvl)
    if untraced is not None:
        warnings.append(f"no .pt2 and no block-wise check: {untraced}; the safetensors output is converted from the "
                        "weights alone (every floating weight stored low at O2) and verified through from_pretrained")
    empty = torch.fx.Graph()
    report = build_report(
        source=Source.of(ckpt.path, "checkpoint", shards=len(ckpt.shards)),
        config={"precision": spec.precision_name, "level": lvl.value, "keep_fp32": spec.patterns("keep_fp32"),
                "force_low": spec.patterns("force_low"), "low_precision_io": spec.low_precision_io,
                "range_rules": vars(rules) if rules is not None else None,
                **({"range_rules_scope": "weights only (streamed statistics)"} if applied else {})},
        records=out.records if out is not None else [],
        plan=out.plan if out is not None else [],
        stats_before=graph_stats(out.original.graph if out is not None else empty, spec.precision),
        stats_after=graph_stats(out.converted.graph if out is not None else empty, spec.precision),
        weights=(ckpt.total_bytes, after),
        metrics=None,
        tolerance=None,
        timings=timings,
        warnings=warnings,
        extra=(WeightRules.of(flagged), *([fp8_section(plan, ckpt)] if plan is not None else [])),
    )  # fmt: skip
    tolerance = split_fp8(full)[0].verification().tolerance
    return StreamedConversion(ckpt, out, dtypes, buffers, keys, report, tolerance,  # type: ignore[arg-type]
                              untraced=untraced, example=inputs, fp8=plan, spec=spec)  # fmt: skip


def _fp32_tensor(ckpt: Checkpoint, keys: KeyMap, buffers: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Program tensor ``name`` in FP32, read from the source shards (or the model's own buffers)."""
    bare = name.removeprefix(PREFIX)
    if bare in keys.sources or bare in keys.tied:
        origin = keys.resolve(bare)
        t = keys.build(origin, lambda k: load_tensor(ckpt.tensors[k]))[origin]
    else:
        t = buffers[name]
    return t.float() if t.dtype.is_floating_point else t


def _check_constants(program: ExportedProgram, keys: KeyMap, buffers: dict[str, torch.Tensor]) -> None:
    """Every program tensor must come from the shards or the model's own buffers: a constant the trace made
    from Python data on the meta device (e.g. Falcon's list indexing ``x[..., [-2], :]`` before transformers
    5.25) has lost its values.

    Raises:
        ExportError: Such a constant (the program would have made-up values; the safetensors output, which
            needs no program, is still converted: ``amplite.checkpoint.untraced``).
    """
    for name in [*program.state_dict, *program.constants]:
        bare = name.removeprefix(PREFIX)
        if bare not in keys.sources and bare not in keys.tied and name not in buffers:
            raise ExportError(f"tracing {type(keys.model).__name__} on the meta device creates a constant tensor "
                              f"({name}) whose values only exist at run time",
                              "convert the loaded model in memory for a program: amplite.convert(model, "
                              "example_inputs)")  # fmt: skip


def storage_dtypes(ckpt: Checkpoint, keys: KeyMap, planned: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """Shard tensor name -> its dtype in a safetensors output: the plan's dtype for the model tensor it
    feeds, never wider than the source's (a bf16 source is never up-cast); unread tensors keep theirs."""
    targets = keys.shard_targets()
    out = {}
    for name, info in ckpt.tensors.items():
        model = targets.get(name, keys.twins.get(name))  # a stored tied twin is stored as what it is tied to
        want = planned.get(PREFIX + model, info.dtype) if model is not None else info.dtype
        floating = info.dtype.is_floating_point and want.is_floating_point
        out[name] = want if floating and want.itemsize <= info.dtype.itemsize else info.dtype
    return out


def storage_warnings(ckpt: Checkpoint, keys: KeyMap, dtypes: dict[str, torch.dtype], level: Level) -> list[str]:
    """What the outputs do not change: an output that stores nothing in low precision, tensors left FP32,
    shard tensors the model never reads."""
    warnings = []
    low = {torch.float16, torch.bfloat16}
    floats = {n: i for n, i in ckpt.tensors.items() if i.dtype.is_floating_point}
    changed = [n for n, i in floats.items() if dtypes[n] != i.dtype]
    wider = [n for n, i in floats.items() if i.dtype.itemsize > 2]  # a bf16/fp16 source is already low precision
    if wider and not changed:
        why = "O1 keeps FP32 master weights" if level == Level.O1 else f"{level.value} keeps these weights' dtypes"
        warnings.append(f"the safetensors output stores every weight in its source dtype ({why}); the mixed-"
                        "precision plan is in the .pt2 (--format pt2), or use --level O2 to store low precision")
    wide = [n for n, i in floats.items() if dtypes[n] not in low and i.nbytes >= 2**16]
    if changed and wide:
        share = sum(floats[n].nbytes for n in wide) / max(1, sum(i.nbytes for i in floats.values()))
        warnings.append(f"{len(wide)} large weights ({share:.0%} of the bytes) stay {str(dtypes[wide[0]])[6:]}, "
                        f"e.g. {wide[0]} (their readers run in FP32: see fp32_nodes)")  # fmt: skip
    if keys.unused:
        warnings.append(f"{len(keys.unused)} shard tensors are not read by the model (e.g. {keys.unused[0]}); they "
                        "are copied unchanged")  # fmt: skip
    return warnings


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` of ``/proc/self/status`` (the high-water mark of this
    program's own memory), else ``ru_maxrss``. Linux carries ``ru_maxrss`` across ``fork``/``exec``, so a
    command started by a process that was larger reports its parent's peak (e.g. a benchmark that generated
    the checkpoint); ``VmHWM`` starts afresh at ``exec``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
