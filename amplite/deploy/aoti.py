"""AOTInductor packages of a converted program (``--format aoti``), verified by running the package itself.

``torch._inductor.aoti_compile_and_package`` compiles the program's graph to C++ (and the device's kernels)
and writes a ``.pt2`` package that ``torch._inductor.aoti_load_package`` — or the C++ runtime, without
Python — runs. The program keeps its dynamic dimensions (the package takes any size the range constraints
allow). What amplite adds:

- **a toolchain check before work starts**: AOTInductor needs a C++ compiler on the machine that packages, and
  the device the program's weights live on; either missing is a one-line error naming it;
- **``amplite::contract`` decomposed**: the fused contraction op is implemented in Python, which a Python-free
  package cannot call, so it is replaced by its ``torch.einsum`` formulation (FP32 accumulation, one rounding:
  the same numbers) before compiling; the count is in the report;
- **verification of the artifact users deploy**: the written package is loaded back and run on the
  verification inputs against the FP32 reference, with the same metrics and tolerances as the ``.pt2``
  (report key ``verification_aoti``; a failure makes ``convert`` exit 1).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from amplite.converter import emit
from amplite.errors import ConfigError, EmitError
from amplite.verify.compare import OutputMetrics, Tolerance, output_names, tensor_metrics


@dataclass
class AotiPackage:
    """A written AOTInductor package.

    Attributes:
        path: The package file.
        device: The device it was compiled for (``cpu``, ``cuda``).
        decomposed_contractions: ``amplite::contract`` nodes replaced by their einsum form for the package.
        compile_seconds: Time AOTInductor took.
        bytes: File size.
    """

    path: str
    device: str
    decomposed_contractions: int
    compile_seconds: float
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        """The ``outputs`` entry of the report."""
        return {"format": "aoti", "path": self.path, "bytes": self.bytes, "device": self.device,
                "decomposed_contractions": self.decomposed_contractions,
                "compile_seconds": round(self.compile_seconds, 3)}  # fmt: skip


@dataclass
class AotiVerification:
    """The package run with ``aoti_load_package`` against the FP32 reference outputs."""

    path: str
    device: str
    metrics: list[OutputMetrics] = field(default_factory=list)
    tolerance: Tolerance | None = None
    outputs_match: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every output within tolerance, and as many outputs as the reference."""
        return self.outputs_match and all(m.passed for m in self.metrics)

    def to_dict(self) -> dict[str, Any]:
        """The ``verification_aoti`` entry of the report."""
        return {
            "runtime": "aotinductor", "path": self.path, "device": self.device, "passed": self.passed,
            "tolerance": vars(self.tolerance) if self.tolerance else None,
            "outputs": [m.to_dict() for m in self.metrics], "seconds": round(self.seconds, 4), "notes": self.notes,
        }  # fmt: skip


def program_device(program: ExportedProgram) -> torch.device:
    """The device of the program's weights (CPU for a program without any)."""
    for value in [*program.state_dict.values(), *program.constants.values()]:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def check_toolchain(program: ExportedProgram) -> None:
    """Refuse before any work when this machine cannot build the package.

    Raises:
        ConfigError: No C++ compiler (AOTInductor compiles C++ on every device), or the program's device
            is not available here.
    """
    from torch._inductor import config

    compiler = os.environ.get("CXX") or config.cpp.cxx[-1] or "g++"
    if shutil.which(compiler) is None and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError(
            f"--format aoti needs a C++ compiler and none was found (tried {compiler!r}, g++, c++, clang++)",
            "install one (e.g. apt-get install g++) or set CXX; or write --format pt2",
        )
    device = program_device(program)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"the program's weights are on {device} but this machine has no CUDA device",
            "package on the machine you deploy to (AOTInductor compiles for the device it runs on)",
        )


def _decompose_contractions(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    from amplite.ops.contract import torch_contract

    op = getattr(getattr(torch.ops, "amplite", None), "contract", None)
    count = sum(1 for n in program.graph.nodes if op is not None and n.target is getattr(op, "default", None))
    if not count:
        return program, 0
    table = {op.default: torch_contract}
    return program.run_decompositions(table), count


def package_aoti(program: ExportedProgram, path: str | Path) -> AotiPackage:
    """Compile ``program`` with AOTInductor and write the package to ``path`` atomically.

    Raises:
        ConfigError: No C++ compiler, or the program's device is missing (see :func:`check_toolchain`).
        EmitError: AOTInductor failed, or the path cannot be written (nothing is left behind).
    """
    check_toolchain(program)
    dest = emit.check_writable(path)
    program, decomposed = _decompose_contractions(program)
    start = perf_counter()
    fd, tmp = tempfile.mkstemp(dir=dest.parent if str(dest.parent) else ".", prefix=f".{dest.name}.", suffix=".pt2")
    os.close(fd)
    try:
        from torch._inductor import aoti_compile_and_package

        with torch.no_grad():
            aoti_compile_and_package(program, package_path=tmp)
        os.replace(tmp, dest)
    except Exception as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, (ConfigError, EmitError)):
            raise
        raise EmitError(
            f"AOTInductor could not compile the program: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
            "write --format pt2 (torch.compile it at load time), or report the failing op",
        ) from None
    return AotiPackage(str(dest), program_device(program).type, decomposed, perf_counter() - start,
                       dest.stat().st_size)  # fmt: skip


def load_aoti(path: str | Path) -> Any:
    """The runnable model of a package (``torch._inductor.aoti_load_package``)."""
    from torch._inductor import aoti_load_package

    return aoti_load_package(str(path))


def verify_aoti(
    path: str | Path, reference: Any, inputs: tuple[tuple[Any, ...], dict[str, Any]], tolerance: Tolerance
) -> AotiVerification:
    """Load the written package, run it on ``inputs`` and compare with the FP32 ``reference`` outputs."""
    start = perf_counter()
    model = load_aoti(path)
    args, kwargs = inputs
    with torch.no_grad():
        got = model(*args, **kwargs)
    result = AotiVerification(str(path), str(getattr(model, "device", "cpu")), tolerance=tolerance)
    refs = [(n, leaf) for n, leaf in zip(output_names(reference), pytree.tree_leaves(reference), strict=True)
            if isinstance(leaf, torch.Tensor)]  # fmt: skip
    outs = [leaf for leaf in pytree.tree_leaves(got) if isinstance(leaf, torch.Tensor)]
    if len(refs) != len(outs):
        result.outputs_match = False
        result.notes.append(f"the package returned {len(outs)} outputs, the reference {len(refs)}")
    result.metrics = [tensor_metrics(n, r, o, tolerance) for (n, r), o in zip(refs, outs, strict=False)]
    result.seconds = perf_counter() - start
    return result
