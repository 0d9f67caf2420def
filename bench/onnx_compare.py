"""The ONNX side of the benchmark: FP32 dynamo export, onnxconverter-common's fp16 conversion, amplite's
ONNX output, and ONNX Runtime (CPU) runs of each.

Cast nodes are counted the same way for every file: ``Cast`` nodes of the default domain in the main graph
and its subgraphs (model-local function bodies are not counted; amplite reports those separately).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bench.autocast_count import accuracy, latency

#: Terminal colour codes (the ONNX exporter colours its error messages).
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: first line`` of an exception and of its direct cause (the exporter wraps the real error),
    shortened to ``limit`` characters."""

    def first(e: BaseException) -> str:
        lines = [ln.strip() for ln in ANSI.sub("", str(e)).strip().splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()

    text = first(exc) + (f" — cause: {first(exc.__cause__)}" if exc.__cause__ is not None else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def quiet():
    """Silence the exporter's progress prints and warnings (they go to stdout, stderr and logging)."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def file_bytes(path: Path) -> int:
    """Size of an ONNX file plus any external data files written beside it."""
    data = [p for p in path.parent.iterdir() if p != path and p.name.startswith(path.name)]
    return path.stat().st_size + sum(p.stat().st_size for p in data)


def count_casts(path: Path) -> int:
    """Cast nodes in the main graph and its subgraphs (If/Loop bodies)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def walk(graph: Any) -> int:
        n = 0
        for node in graph.node:
            n += node.op_type == "Cast" and node.domain in ("", "ai.onnx")
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    n += walk(attr.g)
                n += sum(walk(g) for g in attr.graphs)
        return n

    return walk(model.graph)


def export_fp32(model: torch.nn.Module, inputs: tuple[tuple, dict], path: Path) -> dict[str, Any]:
    """``torch.onnx.export(dynamo=True)`` of the FP32 model: seconds, bytes, Cast nodes."""
    args, kwargs = inputs
    start = perf_counter()
    with quiet():
        torch.onnx.export(model, args, str(path), kwargs=kwargs, dynamo=True)
    return {"export_s": perf_counter() - start, "bytes": file_bytes(path), "casts": count_casts(path)}


def onnx_feed(session: Any, inputs: tuple[tuple, dict]) -> dict[str, np.ndarray]:
    """Session inputs from the flattened example inputs, in order (the exporter keeps pytree order)."""
    args, kwargs = inputs
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(leaves):
        raise ValueError(f"the ONNX model has {len(names)} inputs, the example inputs {len(leaves)} tensors")
    return {n: t.detach().cpu().numpy() for n, t in zip(names, leaves, strict=True)}


def run_ort(path: Path, inputs: tuple[tuple, dict], reference: Any, *, logits: bool, time_it: bool) -> dict[str, Any]:
    """Load ``path`` in ONNX Runtime (CPU), score its first output against ``reference`` and time it.

    The result holds ``ort_error`` (the refusal text) when the session cannot be created or run.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = onnx_feed(session, inputs)
        outputs = session.run(None, feed)
    except Exception as exc:
        return {"ort_error": one_line(exc)}
    first = torch.from_numpy(np.asarray(outputs[0]).astype(np.float32))
    result: dict[str, Any] = {"accuracy": accuracy(reference, first, logits=logits)}
    result["accuracy"]["nonfinite"] = sum(int((~np.isfinite(o)).sum()) for o in outputs if o.dtype.kind == "f")
    if time_it:
        result["latency"] = latency(lambda: session.run(None, feed))
    return result


def onnxconverter_common_fp16(fp32_path: Path, path: Path) -> dict[str, Any]:
    """``convert_float_to_float16(keep_io_types=True)`` on the FP32 export: seconds, bytes, casts, checker."""
    import onnx
    from onnxconverter_common import float16

    start = perf_counter()
    with quiet():
        converted = float16.convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    seconds = perf_counter() - start
    onnx.save(converted, str(path))
    result: dict[str, Any] = {"convert_s": seconds, "bytes": file_bytes(path), "casts": count_casts(path)}
    try:
        onnx.checker.check_model(str(path), full_check=True)
        result["checker"] = "passed"
    except Exception as exc:
        result["checker"] = one_line(exc)
    return result


def amplite_onnx(program: Any, path: Path, precision: str) -> dict[str, Any]:
    """amplite's ONNX output of a converted program (``amplite.converter.onnx_export.save_onnx``)."""
    from amplite.converter.onnx_export import save_onnx

    start = perf_counter()
    with quiet():
        info = save_onnx(program, path, precision=precision)
    return {"export_s": perf_counter() - start, "bytes": info.bytes, "casts": count_casts(path),
            "casts_amplite": info.casts, "checker": info.checker}
