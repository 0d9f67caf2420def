"""``ConversionResult``: a converted program, its report, and how to save it (``.pt2`` or ``.onnx``).

Layer: beside the API (``amplite.api`` returns it); it uses ``converter.emit``, ``report``, ``verify`` and,
on demand, ``onnx``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

from torch import nn
from torch.export import ExportedProgram

from amplite.converter import emit
from amplite.converter.pipeline import PipelineOutput
from amplite.converter.tracing import Inputs
from amplite.report.document import Report
from amplite.report.schema import report_json
from amplite.report.sections import Outputs, Timings, VerificationAoti, VerificationOnnx
from amplite.spec import ConvertSpec
from amplite.verify.compare import Tolerance


@dataclass
class ConversionResult:
    """A converted model with its report.

    Attributes:
        program: The converted ExportedProgram.
        report: The conversion report.
        original: The FP32 ExportedProgram it was made from.
        inputs: The example inputs used for tracing and verification.
        spec: The conversion's settings (recorded whole in a saved ``.pt2``).
    """

    program: ExportedProgram
    report: Report
    original: ExportedProgram
    inputs: Inputs
    pipeline: PipelineOutput | None = field(default=None, repr=False)
    reference: Any = field(default=None, repr=False)  # FP32 outputs on ``inputs``
    tolerance: Tolerance | None = field(default=None, repr=False)  # set when verification ran
    spec: ConvertSpec = field(default_factory=ConvertSpec)

    def module(self) -> nn.Module:
        """The converted model as a callable module."""
        return self.program.module()

    @property
    def passed(self) -> bool | None:
        """Whether verification passed (None if it did not run)."""
        return self.report.passed

    def recorded_conversion(self) -> dict[str, Any]:
        """What a saved .pt2 records of its conversion (``extra/amplite.json``): the spec (``check --converted``
        reads it back as a spec), the amplite version, and for readers the report's ``config`` and verdict."""
        config = json.loads(report_json(self.report.data["config"]))
        return emit.conversion_record(self.spec, config, self.report.passed)

    def save(
        self,
        path: str | Path,
        *,
        format: str | None = None,
        external_data: bool | None = None,
        opset: int | None = None,
        layernorm_stash: str = "off",
    ) -> Path:
        """Save the converted model; the format (``pt2``, ``onnx``, ``aoti``) comes from the suffix unless given.

        An AOTInductor package (``format="aoti"``, a ``.pt2`` that ``torch._inductor.aoti_load_package`` runs) is
        loaded back and run against the FP32 reference when ``convert`` verified (report key
        ``verification_aoti``).

        An ONNX file is checked with ``onnx.checker`` and, when ``convert`` verified the model, run in ONNX
        Runtime against the same FP32 reference (report key ``verification_onnx``).

        Args:
            path: Destination file.
            format: ``pt2``, ``onnx`` or ``aoti`` (default: from the suffix; ``aoti`` only when given).
            external_data: ONNX only: force (True) or forbid (False) external weights; None decides by size.
            opset: ONNX only: default-domain opset (None: 20 for fp16, 22 for bf16).
            layernorm_stash: ONNX only: ``off`` (default) keeps FP32 LayerNorm islands; ``stash`` writes
                them as one low-precision ``LayerNormalization`` (FP32 statistics via ``stash_type``) when
                scale and bias are exact in the low dtype, ``round`` always, rounding them. The rewrite
                matches ONNX Runtime's kernels, not the ONNX spec (which rounds before scale and bias).

        Raises:
            ConfigError: Unknown format or an opset too old. ExportError: an op has no ONNX translation.
            EmitError: The path cannot be written (nothing is left behind).
        """
        fmt = emit.format_for(path, format)
        start = perf_counter()
        if fmt == "onnx":
            out, entry = self._save_onnx(path, external_data, opset, layernorm_stash)
        elif fmt == "aoti":
            out, entry = self._save_aoti(path)
        else:
            out = emit.save_program(self.program, path, self.recorded_conversion())
            entry = {"format": "pt2", "path": str(out), "bytes": out.stat().st_size}
        # a save runs after convert returned this result and its (frozen) report: rebind a new report with it
        report = self.report
        self.report = report.with_sections(report.section(Timings).add(**{f"save_{fmt}": perf_counter() - start}),
                                           (report.section(Outputs) or Outputs.of([])).with_entries(entry))  # fmt: skip
        return out

    def _save_aoti(self, path: str | Path) -> tuple[Path, dict]:
        from amplite.deploy import package_aoti, verify_aoti  # inductor imports in seconds: only when used

        package = package_aoti(self.program, path)
        if self.tolerance is not None and self.reference is not None:
            checked = verify_aoti(package.path, self.reference, self.inputs, self.tolerance)
            self.report = self.report.with_sections(VerificationAoti.of(checked.to_dict()))
        return Path(package.path), package.to_dict()

    def _save_onnx(
        self, path: str | Path, external_data: bool | None, opset: int | None, layernorm_stash: str
    ) -> tuple[Path, dict]:
        from amplite.onnx.export import save_onnx  # onnx/onnxscript import in ~2 s: only when used
        from amplite.onnx.verify import verify_onnx

        info = save_onnx(
            self.program,
            path,
            precision=self.spec.precision_name,  # fp8 has no ONNX form: refused there
            low_precision_io=self.spec.low_precision_io,
            external_data=external_data,
            opset=opset,
            layernorm_stash=layernorm_stash,
        )
        out = Path(info.path)
        if self.tolerance is not None and self.reference is not None:
            checked = verify_onnx(out, self.reference, self.inputs, self.tolerance)
            self.report = self.report.with_sections(VerificationOnnx.of(checked.to_dict()))
        return out, {"format": "onnx", **info.to_dict()}
