"""Convert a transformers checkpoint directory without materialising it.

The plan needs only the graph and the weights' metadata: the model is built from ``config.json`` with
meta parameters, exported on meta example inputs, and run through amplite's passes (no calibration: the
activation range rules need a forward with real weights; for fp16 the weight rules run on statistics
streamed from the shards, one tensor at a time). The outputs are then written by streaming each weight
from its shard, cast to its planned dtype (``amplite.checkpoint.write``).
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.checkpoint.blockwise import verify_blockwise
from amplite.checkpoint.keys import KeyMap, map_keys
from amplite.checkpoint.model import build_meta_model
from amplite.checkpoint.source import PREFIX, Checkpoint, example_inputs_for, iter_shard, load_tensor, open_checkpoint
from amplite.checkpoint.write import Pt2Weights, cast_tensor, write_pt2, write_safetensors_dir
from amplite.converter.graph_stats import graph_stats
from amplite.converter.pipeline import PipelineOutput, run_pipeline
from amplite.errors import ConfigError
from amplite.passes.range_guard import RangeRules, weight_reason
from amplite.policy import LEVEL_ENV, Level, PrecisionPolicy, make_overrides, resolve_level
from amplite.report.document import Report, pass_records, report_header
from amplite.verify.compare import DEFAULT_TOLERANCES, Tolerance

Progress = Callable[[str, int, int], None]  # (step, bytes done, bytes total)


def _no_progress(step: str, done: int, total: int) -> None:
    return None


@dataclass
class StreamedConversion:
    """A converted checkpoint: the program (meta weights), its plan and where each weight comes from.

    Attributes:
        checkpoint: The source directory's metadata.
        pipeline: The passes' output (``converted`` holds meta tensors in their planned dtypes).
        dtypes: Tensor name -> storage dtype in the output.
        buffers: Real values of the buffers the model computes itself (not in the shards).
        keys: Which shard tensors make each model tensor (transformers' own mapping).
        data: The report document (``report.json``); :attr:`report` wraps it.
    """

    checkpoint: Checkpoint
    pipeline: PipelineOutput
    dtypes: dict[str, torch.dtype]
    buffers: dict[str, torch.Tensor]
    keys: KeyMap
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def report(self) -> Report:
        """The report (``report.data`` is report.json)."""
        return Report(self.data)

    @property
    def passed(self) -> bool | None:
        """Whether block-wise verification passed (None until :meth:`verify` ran)."""
        return (self.data.get("verification") or {}).get("passed")

    @property
    def program(self) -> ExportedProgram:
        """The converted program (weights on the meta device: save it to get them)."""
        return self.pipeline.converted

    def tensor(self, name: str, source: Checkpoint | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One weight read from ``source`` (default: the input checkpoint), cast to ``dtype`` (default: its
        planned storage dtype)."""
        ckpt = source or self.checkpoint
        model_name = name.removeprefix(PREFIX)
        if model_name in self.keys.sources or model_name in self.keys.tied:
            origin = self.keys.resolve(model_name)
            t = self.keys.build(origin, lambda k: load_tensor(ckpt.tensors[k]))[origin]
        elif name in self.buffers:
            t = self.buffers[name]
        else:
            raise ConfigError(f"the checkpoint has no tensor for {name!r}", "check that the shards are complete")
        return cast_tensor(t, dtype or self.dtypes.get(name, t.dtype))

    def save_safetensors(self, out_dir: str | Path, progress: Progress = _no_progress) -> Path:
        """Write the converted checkpoint in the source's layout (plus ``amplite-plan.json``)."""
        total, done = self.checkpoint.total_bytes, [0]

        def step(n: int) -> None:
            done[0] += n
            progress("writing safetensors", done[0], total)

        plan = {"config": self.data.get("config"), "dtypes": {k: str(v) for k, v in self.dtypes.items()},
                "plan": self.pipeline.plan}  # fmt: skip
        return write_safetensors_dir(self.checkpoint, Path(out_dir), self.dtypes, plan, step)

    def save_pt2(self, dest: str | Path, progress: Progress = _no_progress) -> Path:
        """Write a ``.pt2`` whose weights are the converted tensors, streamed one at a time."""
        names = [*self.program.state_dict, *self.program.constants]
        total, done = sum(_meta_bytes(self.program, n) for n in names), [0]

        def step(n: int) -> None:
            done[0] += n
            progress("writing .pt2", done[0], total)

        sources = {n: (lambda n=n: self.tensor(n)) for n in names}
        return write_pt2(self.program, Path(dest), sources, step, self.aliases(names))

    def save(
        self, path: str | Path, *, format: str | None = None, verify: bool = True, inputs: Any = None,
        progress: Progress = _no_progress,
    ) -> Path:
        """Write the converted checkpoint as the CLI does: ``X.pt2`` is a ``.pt2``, any other path a
        safetensors directory (``format``: ``safetensors``, ``pt2`` or both, comma-separated), behind the
        same output guard. Nothing partial is left on failure. Then, unless ``verify=False``, what was written
        is verified block by block against the source (:meth:`verify`; the verdict is :attr:`passed`).

        Args:
            path: Output path (``X.pt2`` or a directory).
            format: ``safetensors``, ``pt2`` or both (default: from ``path``).
            verify: Verify the written weights (from the safetensors directory when one was written).
            inputs: Real ``(args, kwargs)`` for verification (default: seeded random ``input_ids``).
            progress: Called as ``(step, bytes done, bytes total)``.

        Returns:
            The first output written.

        Raises:
            ConfigError: A bad format or an existing output directory / unwritable path.
        """
        from amplite.checkpoint.files import _remove, check_outputs, plan_checkpoint_outputs, write_outputs

        level = str(self.data.get("config", {}).get("level", "O2"))
        precision = str(self.data.get("config", {}).get("precision", "fp16"))
        targets = plan_checkpoint_outputs(self.checkpoint.path, path, format, precision, level)
        check_outputs(targets)
        written: list[Path] = []
        try:
            write_outputs(self, targets, progress, written)
        except BaseException:
            for p in written:
                _remove(p)
            raise
        fresh = [{"format": f, "path": str(p)} for f, p in targets]
        kept = [e for e in self.data.get("outputs", []) if e.get("path") not in {x["path"] for x in fresh}]
        self.data["outputs"] = [*kept, *fresh]  # earlier saves stay listed, as for a module's result
        if verify:
            self.verify(next((p for f, p in targets if f == "safetensors"), targets[0][1]), inputs, progress=progress)
        return written[0]

    def module(self) -> Any:
        """Not available: a streamed checkpoint's weights are never materialised in memory.

        Raises:
            ConfigError: Always, naming what to use instead.
        """
        raise ConfigError(
            "a converted checkpoint directory has no in-memory module (its weights stay in the shards)",
            "result.save(DIR) then transformers' AutoModelForCausalLM.from_pretrained(DIR), or "
            "result.save('model.pt2') then torch.export.load('model.pt2').module()",
        )

    def aliases(self, names: list[str]) -> dict[str, str]:
        """Program weight -> an earlier one with the same values and dtype (tied weights: stored once)."""
        first: dict[tuple[str, torch.dtype | None], str] = {}
        out = {}
        for name in names:
            bare = name.removeprefix(PREFIX)
            if bare not in self.keys.sources and bare not in self.keys.tied:
                continue
            key = (self.keys.resolve(bare), self.dtypes.get(name))
            if key in first:
                out[name] = first[key]
            else:
                first[key] = name
        return out


    def verify(
        self, converted_dir: str | Path, inputs: Any = None, *, tolerance: Tolerance | None = None,
        max_memory_gb: float | None = None, progress: Progress = _no_progress,
    ) -> dict[str, Any]:
        """Block-wise streaming verification of the written safetensors directory against the source.

        Args:
            converted_dir: What :meth:`save_safetensors` wrote (the converted weights are read from there).
            inputs: Real ``(args, kwargs)`` (default: seeded random ``input_ids`` of shape (1, 8)).
            tolerance: Output thresholds (default: by precision).
            max_memory_gb: Bound on the weights alive at once (``--verify-max-memory``).
            progress: Called as ``("verifying", bytes loaded, total)``.

        Returns:
            The ``verification`` section (also stored in :attr:`report`).
        """
        if inputs is None or _on_meta(inputs):
            inputs = random_inputs(self.pipeline.original, int(self.checkpoint.config.get("vocab_size", 2)))
        converted_dir = Path(converted_dir)
        if converted_dir.is_dir():
            written = open_checkpoint(converted_dir)
            load_converted = lambda n: self.tensor(n, source=written)  # noqa: E731
        else:  # a .pt2: its weights are read back from the archive, one at a time
            reader = Pt2Weights(converted_dir)
            load_converted = reader.tensor
        precision = self.data["config"]["precision"]
        start = perf_counter()
        section = verify_blockwise(
            self.pipeline.original, self.program, inputs,
            lambda n: self.tensor(n, dtype=torch.float32), load_converted,
            tolerance or DEFAULT_TOLERANCES[precision],
            max_memory=max_memory_gb * 2**30 if max_memory_gb is not None else None, progress=progress,
        )  # fmt: skip
        self.data["timings"]["verify"] = perf_counter() - start
        self.data["verification"] = section
        return section


def _on_meta(inputs: Any) -> bool:
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


def random_inputs(program: ExportedProgram, vocab: int) -> tuple[tuple, dict[str, Any]]:
    """Seeded inputs shaped like the traced ones: token ids below ``vocab``, masks of ones, floats ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(0)

    def fake(name: str, t: torch.Tensor) -> torch.Tensor:
        if "mask" in name:
            return torch.ones(t.shape, dtype=t.dtype)
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=gen).to(t.dtype)
        return torch.randint(0, max(vocab, 1), t.shape, generator=gen, dtype=t.dtype)

    args, kwargs = program.example_inputs
    return tuple(fake(f"arg{i}", a) for i, a in enumerate(args)), {k: fake(k, v) for k, v in kwargs.items()}


def _meta_bytes(program: ExportedProgram, name: str) -> int:
    t = program.state_dict.get(name, program.constants.get(name))
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


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
    precision: str = "fp16",
    level: str | Level | None = None,
    keep_fp32: Sequence[str] = (),
    force_low: Sequence[str] = (),
    low_precision_io: bool = False,
    range_rules: bool | None = None,
    progress: Progress = _no_progress,
) -> StreamedConversion:
    """Plan the conversion of a checkpoint directory from its config and weight metadata.

    Args:
        path: A directory with ``config.json`` and sharded (or single) ``*.safetensors``.
        example_inputs: ``(args, kwargs)`` for tracing (default: ``input_ids`` of shape (1, 8)); moved to meta.
        precision, level, keep_fp32, force_low, low_precision_io: As for :func:`amplite.convert`.
        range_rules: Apply the fp16 weight rules on streamed statistics (None: at O1/O2).
        progress: Called as ``(step, bytes done, bytes total)`` while reading shards.

    Returns:
        The planned conversion; ``save_safetensors`` / ``save_pt2`` write it by streaming.
    """
    timings: dict[str, float] = {}
    start = perf_counter()
    ckpt = open_checkpoint(path)
    lvl = checkpoint_level(level)
    model, buffers = build_meta_model(ckpt)
    keys = map_keys(ckpt, model.lm)
    inputs = example_inputs if example_inputs is not None else example_inputs_for(ckpt.config)
    inputs = torch.utils._pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, inputs)
    timings["build"] = perf_counter() - start
    start = perf_counter()
    use_rules = range_rules if range_rules is not None else lvl in (Level.O1, Level.O2)
    flagged = weight_rules(ckpt, keys, progress, RangeRules()) if use_rules and precision == "fp16" else {}
    timings["weight_statistics"] = perf_counter() - start
    # fp16 weight rules; patterns see the user's module names (model.layers.0...), not the wrapper's lm.
    pins = make_overrides([f"module:{m.removeprefix(PREFIX)}" for m in flagged], source="checkpoint")
    policy = PrecisionPolicy(precision, lvl, (*make_overrides(keep_fp32, force_low), *pins), low_precision_io,
                             module_prefix=PREFIX)  # fmt: skip
    out = run_pipeline(model, inputs, policy, fold_batchnorm=False)
    timings.update(out.timings)
    _check_constants(out.converted, keys, buffers)
    dtypes = {name: t.dtype for name, t in [*out.converted.state_dict.items(), *out.converted.constants.items()]
              if isinstance(t, torch.Tensor)}  # fmt: skip
    dtypes.update(storage_dtypes(ckpt, keys, dtypes))
    conv = StreamedConversion(ckpt, out, dtypes, buffers, keys)
    after = sum(math.prod(i.shape) * dtypes[n].itemsize for n, i in ckpt.tensors.items())
    applied = bool(flagged or use_rules)
    conv.data = {
        **report_header(),
        "source": {"path": str(ckpt.path), "format": "checkpoint", "shards": len(ckpt.shards)},
        "config": {"precision": precision, "level": lvl.value, "keep_fp32": list(keep_fp32),
                   "force_low": list(force_low), "low_precision_io": low_precision_io,
                   "range_rules": vars(RangeRules()) if applied else None,
                   **({"range_rules_scope": "weights only (streamed statistics)"} if applied else {})},
        "passes": pass_records(out.records),
        "weight_rules": [{"module": m, "reason": r} for m, r in flagged.items()],
        "graph": {"before": graph_stats(out.original.graph, policy.low_dtype),
                  "after": graph_stats(out.converted.graph, policy.low_dtype)},
        "weights": {"bytes_before": ckpt.total_bytes, "bytes_after": after,
                    "ratio": round(after / ckpt.total_bytes, 4) if ckpt.total_bytes else 1.0},
        "fp32_nodes": [p for p in out.plan if p["mode"] == "fp32"],
        "plan": out.plan,
        "warnings": storage_warnings(ckpt, keys, dtypes, lvl),
        "timings": timings,
    }  # fmt: skip
    return conv


def _check_constants(program: ExportedProgram, keys: KeyMap, buffers: dict[str, torch.Tensor]) -> None:
    """Every program tensor must come from the shards or the model's own buffers: a constant the trace made
    from Python data on the meta device (e.g. Falcon's list indexing ``x[..., [-2], :]``) has lost its values.

    Raises:
        ConfigError: Such a constant (the conversion would write a program with made-up values).
    """
    for name in [*program.state_dict, *program.constants]:
        bare = name.removeprefix(PREFIX)
        if bare not in keys.sources and bare not in keys.tied and name not in buffers:
            raise ConfigError(f"tracing {type(keys.model).__name__} on the meta device creates a constant tensor "
                              f"({name}) whose values only exist at run time; amplite cannot stream this "
                              "architecture yet", "convert the loaded model in memory: amplite.convert(model, "
                              "example_inputs)")  # fmt: skip


def checkpoint_level(level: str | Level | None) -> Level:
    """The level for a checkpoint: as given (or ``AMPLITE_LEVEL``), else O2, which stores low-precision
    weights (O1 keeps FP32 masters: its safetensors output would be the source unchanged)."""
    if level is None and not os.environ.get(LEVEL_ENV):
        return Level.O2
    return resolve_level(level)


def storage_dtypes(ckpt: Checkpoint, keys: KeyMap, planned: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """Shard tensor name -> its dtype in a safetensors output: the plan's dtype for the model tensor it
    feeds, never wider than the source's (a bf16 source is never up-cast); unread tensors keep theirs."""
    targets = keys.shard_targets()
    out = {}
    for name, info in ckpt.tensors.items():
        want = planned.get(PREFIX + targets[name], info.dtype) if name in targets else info.dtype
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
    if floats and not changed:
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
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
