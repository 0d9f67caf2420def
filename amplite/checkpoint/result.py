"""The result of converting a checkpoint directory: :class:`StreamedConversion` (the program with meta
weights, its plan, where each weight comes from) and what it does: write the outputs by streaming
(``save``, ``save_safetensors``, ``save_pt2``) and verify what was written block by block (``verify``).

``amplite.checkpoint.convert`` plans it; ``amplite.checkpoint.files`` is the CLI's writer around it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from amplite.checkpoint.blockwise import verify_blockwise
from amplite.checkpoint.example_inputs import meta_bytes, on_meta, random_inputs
from amplite.checkpoint.fp8 import Fp8Plan, Fp8Reader, linear_weight
from amplite.checkpoint.keys import KeyMap
from amplite.checkpoint.loader import check_loadable, loader_dtypes
from amplite.checkpoint.source import PREFIX, Checkpoint, load_tensor, open_checkpoint
from amplite.checkpoint.write import Pt2Weights, cast_tensor, write_pt2, write_safetensors_dir
from amplite.converter import emit
from amplite.converter.pipeline import PipelineOutput
from amplite.errors import ConfigError
from amplite.report.document import Report
from amplite.report.sections import Outputs, Timings, Verification, WeightRules
from amplite.spec import ConvertSpec
from amplite.verify.compare import DEFAULT_TOLERANCES, Tolerance

Progress = Callable[[str, int, int], None]  # (step, bytes done, bytes total)


def _no_progress(step: str, done: int, total: int) -> None:
    return None


#: ``(source directory, tolerance, precision) -> check or None``: the generation check a tolerance's
#: ``token_agreement``/``ppl_delta`` criteria ask for, registered by ``amplite.llm.checkpoint`` (a layer above,
#: imported with ``amplite``), so that :meth:`StreamedConversion.save` gates as ``amplite convert DIR`` does.
GenerationCheckFactory = Callable[[Path, Any, str], "Callable[[Report, Path], list[str]] | None"]
_GENERATION_CHECK: list[GenerationCheckFactory] = []


def register_generation_check(factory: GenerationCheckFactory) -> None:
    """Install the factory of the generation check (``amplite.llm.checkpoint.generation_check``)."""
    _GENERATION_CHECK[:] = [factory]


@dataclass
class StreamedConversion:
    """A converted checkpoint: the program (meta weights), its plan and where each weight comes from.

    Attributes:
        checkpoint: The source directory's metadata.
        pipeline: The passes' output (``converted`` holds meta tensors in their planned dtypes).
        dtypes: Tensor name -> storage dtype in the output.
        buffers: Real values of the buffers the model computes itself (not in the shards).
        keys: Which shard tensors make each model tensor (transformers' own mapping).
        report: The report (``report.data`` is report.json), built by :func:`~amplite.checkpoint.convert.
            convert_checkpoint` from the same section builders as a module's.
        tolerance: The tolerance of the options (``save`` verifies by it; None: the precision's default).
        untraced: Why the model has no program (it does not trace on meta), None when it has one: then
            ``pipeline`` is None, there is no ``.pt2`` and verification runs through ``from_pretrained``
            (``amplite.checkpoint.untraced``).
        example: The (meta) example inputs the model was traced with.
        fp8: For ``precision="fp8"``: which weights are stored FP8, the activation scheme and scales.
        spec: The conversion's settings (``to_json`` is the written ``amplite-plan.json``'s ``spec``).
    """

    checkpoint: Checkpoint
    pipeline: PipelineOutput
    dtypes: dict[str, torch.dtype]
    buffers: dict[str, torch.Tensor]
    keys: KeyMap
    report: Report = field(default_factory=Report)
    tolerance: Tolerance | None = None
    untraced: str | None = None
    example: Any = None
    fp8: Fp8Plan | None = None
    spec: ConvertSpec = field(default_factory=lambda: ConvertSpec(path="checkpoint"))

    @property
    def data(self) -> Mapping[str, Any]:
        """The report document (``report.json``), read-only: ``report.data``."""
        return self.report.data

    @property
    def passed(self) -> bool | None:
        """Whether block-wise verification passed (None until :meth:`verify` ran)."""
        return self.report.passed

    @property
    def program(self) -> ExportedProgram:
        """The converted program (weights on the meta device: save it to get them).

        Raises:
            ConfigError: The model did not trace on meta (:attr:`untraced`): no program.
        """
        if self.untraced is not None:
            raise ConfigError(f"no .pt2 for this checkpoint: {self.untraced}",
                              "use the safetensors output (a directory), which is converted and verified")  # fmt: skip
        return self.pipeline.converted

    def writable(self, targets: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
        """The outputs this conversion can write: without a program the ``.pt2`` is left out (and said in the
        report's warnings); asked for alone, it is refused.

        Raises:
            ConfigError: Only a ``.pt2`` was asked for, and there is no program.
        """
        if self.untraced is None or all(f != "pt2" for f, _ in targets):
            return targets
        if all(f == "pt2" for f, _ in targets):
            _ = self.program  # raises, naming why
        return [(f, p) for f, p in targets if f != "pt2"]

    def tensor(
        self, name: str, source: Checkpoint | None = None, dtype: torch.dtype | None = None,
        load: Callable[[str], torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One weight read from ``source`` (default: the input checkpoint; ``load``: shard tensor name -> its
        values, e.g. FP8 weights dequantized), cast to ``dtype`` (default: its planned storage dtype)."""
        ckpt = source or self.checkpoint
        read = load or (lambda k: load_tensor(ckpt.tensors[k]))
        model_name = name.removeprefix(PREFIX)
        if model_name in self.keys.sources or model_name in self.keys.tied:
            origin = self.keys.resolve(model_name)
            t = self.keys.build(origin, read)[origin]
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

        plan = {"config": self.data.get("config"), "spec": self.spec.to_json(),
                "dtypes": {k: str(v) for k, v in self.dtypes.items()},
                "plan": self.pipeline.plan if self.pipeline is not None else []}  # fmt: skip
        if self.fp8 is not None:
            plan = {**plan, "fp8": {"activation_scheme": self.fp8.scheme, "fp8_linears": sorted(self.fp8.linears),
                                    "input_amax": self.fp8.input_amax or None}}  # fmt: skip
        return write_safetensors_dir(self.checkpoint, Path(out_dir), self.dtypes, plan, step, self.fp8)

    def save_pt2(self, dest: str | Path, progress: Progress = _no_progress) -> Path:
        """Write a ``.pt2`` whose weights are the converted tensors, streamed one at a time.

        Raises:
            ConfigError: An FP8 conversion (its output is a safetensors directory in vLLM's layout).
        """
        if self.fp8 is not None:
            raise ConfigError("--precision fp8 writes a safetensors directory in vLLM's layout, not a .pt2",
                              "drop --format pt2 / -o X.pt2 (write -o DIR), or convert to bf16 for a .pt2")  # fmt: skip
        names = [*self.program.state_dict, *self.program.constants]
        total, done = sum(meta_bytes(self.program, n) for n in names), [0]

        def step(n: int) -> None:
            done[0] += n
            progress("writing .pt2", done[0], total)

        sources = {n: (lambda n=n: self.tensor(n)) for n in names}
        record = emit.conversion_record(self.spec, self.data.get("config"))  # check --converted reads the spec back
        return write_pt2(self.program, Path(dest), sources, step, self.aliases(names), record)

    def save(
        self,
        path: str | Path,
        *,
        format: str | None = None,
        verify: bool = True,
        inputs: Any = None,
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
        from amplite.checkpoint.outputs import _remove, _size, check_outputs, plan_checkpoint_outputs, write_outputs

        targets = plan_checkpoint_outputs(self.checkpoint.path, path, format, self.spec)
        check_outputs(targets)
        # token_agreement / ppl_delta criteria: the written directory is also checked on generation (as the CLI)
        make = _GENERATION_CHECK[0] if _GENERATION_CHECK else None
        precision = self.spec.precision_name
        generation = make(self.checkpoint.path, self.tolerance, precision) if verify and make is not None else None
        targets = self.writable(targets)
        if any(f == "safetensors" for f, _ in targets):
            self.check_loadable()
        if generation is not None and not any(f == "safetensors" for f, _ in targets):
            raise ConfigError("token_agreement/ppl_delta are measured on the safetensors output, and none is written",
                              "add it: format='safetensors,pt2' (or a directory path)")  # fmt: skip
        written: list[Path] = []
        try:
            write_outputs(self, targets, progress, written)
        except BaseException:
            for p in written:
                _remove(p)
            raise
        fresh = [{"format": f, "path": str(p), "bytes": _size(p)} for f, p in targets]
        # earlier saves stay listed, as for a module's result
        self.report = self.report.with_sections((self.report.section(Outputs) or Outputs.of([])).with_entries(*fresh))
        if verify:
            weights = next((p for f, p in targets if f == "safetensors"), targets[0][1])
            self.verify(weights, inputs, tolerance=self.tolerance, progress=progress)
            if generation is not None:
                self.report, _ = generation(self.report, weights)
        return written[0]

    def check_loadable(self) -> None:
        """Refuse a safetensors output that ``from_pretrained`` would load broken, before anything is written
        (:func:`amplite.checkpoint.loader.check_loadable`)."""
        check_loadable(self.checkpoint, self.keys, self.dtypes, self.report.section(WeightRules) or WeightRules())

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
        self,
        converted_dir: str | Path,
        inputs: Any = None,
        *,
        tolerance: Tolerance | None = None,
        max_memory_gb: float | None = None,
        progress: Progress = _no_progress,
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
        vocab = int(self.checkpoint.config.get("vocab_size", 2))
        precision = self.spec.precision_name
        if self.untraced is not None:  # no program to walk: the written directory through from_pretrained
            from amplite.checkpoint.untraced import real_inputs, verify_through_loader

            start = perf_counter()
            real = inputs if inputs is not None and not on_meta(inputs) else real_inputs(self.example, vocab)
            tol = tolerance or DEFAULT_TOLERANCES[precision]
            section = verify_through_loader(self.checkpoint, self.keys, Path(converted_dir), real, tol)
            self._verified(section, perf_counter() - start)
            return section
        if inputs is None or on_meta(inputs):
            inputs = random_inputs(self.pipeline.original, vocab)
        converted_dir = Path(converted_dir)
        hook = None
        if converted_dir.is_dir():
            written = open_checkpoint(converted_dir)
            if "quantization_config" in written.config:  # FP8: dequantized weights, quantized linear inputs
                fp8_reader = Fp8Reader(written)
                load_converted = lambda n: self.tensor(n, load=fp8_reader.tensor)  # noqa: E731
                hook = self._fp8_inputs(fp8_reader)
            else:  # read as from_pretrained reads it: each weight in the dtype the loader gives it
                loaded = loader_dtypes(self.keys.model, written.config)

                def load_converted(n: str) -> torch.Tensor:
                    t = self.tensor(n, source=written, dtype=loaded(n.removeprefix(PREFIX)))
                    return cast_tensor(t, self.dtypes.get(n, t.dtype))  # then what the program computes in
        else:  # a .pt2: its weights are read back from the archive, one at a time
            reader = Pt2Weights(converted_dir)
            load_converted = reader.tensor
        original = self.pipeline.original  # the reference reads each tensor in its traced dtype (a bf16 buffer stays)
        traced = {n: t.dtype for n, t in [*original.state_dict.items(), *original.constants.items()]
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        start = perf_counter()
        section = verify_blockwise(
            self.pipeline.original, self.program, inputs,
            lambda n: self.tensor(n, dtype=traced.get(n, torch.float32)), load_converted,
            tolerance or DEFAULT_TOLERANCES[precision],
            max_memory=max_memory_gb * 2**30 if max_memory_gb is not None else None, progress=progress,
            converted_hook=hook,
        )  # fmt: skip
        self._verified(section, perf_counter() - start)  # verify_blockwise builds the block-wise section
        return section

    def _verified(self, section: dict[str, Any], seconds: float) -> None:
        """Rebind :attr:`report` to a new one holding the ``verification`` section and its time (verification
        runs after the conversion built its report, which is frozen)."""
        self.report = self.report.with_sections(self.report.section(Timings).add(verify=seconds),
                                                Verification.from_json(section))  # fmt: skip


    def _fp8_inputs(self, reader: Fp8Reader) -> Callable[[torch.fx.Node, tuple[Any, ...]], tuple[Any, ...]]:
        """The converted program's hook: each FP8 linear's input quantized as the server does (its scale)."""

        def hook(node: torch.fx.Node, args: tuple[Any, ...]) -> tuple[Any, ...]:
            weight = linear_weight(node)
            bare = weight.removeprefix(PREFIX) if weight is not None else None
            src = self.keys.sources.get(bare) if bare is not None else None
            if src is None or src.converter is not None:
                return args
            return (reader.quantize_input(src.keys[0][0], args[0]), *args[1:])

        return hook
