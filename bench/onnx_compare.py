"""The ONNX side of the benchmark: FP32 dynamo export, onnxconverter-common's fp16 conversion, amplite's
ONNX output, and ONNX Runtime (CPU) runs of each.

Cast nodes are counted the same way for every file: ``Cast`` nodes of the default domain in the main graph
and its subgraphs (model-local function bodies are not counted; amplite reports those separately).

onnxconverter-common runs twice: with its defaults (the issue's baseline: norms, softmax and reductions in
fp16), and keeping in FP32 the op types amplite's own file of the same configuration keeps in FP32
(:func:`occ_same_fp32_ops`, like for like at op-type granularity).
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
    """``Type: first line`` of an exception and of its direct cause (the exporter wraps the real error; an
    amplite error names its own), shortened to ``limit`` characters."""

    def first(e: BaseException) -> str:
        lines = [ln.strip() for ln in ANSI.sub("", str(e)).strip().splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()

    from amplite.errors import AmpliteError

    # amplite's own one-line errors already name their cause
    cause = exc.__cause__ if not isinstance(exc, AmpliteError) else None
    text = first(exc) + (f" — cause: {first(cause)}" if cause is not None else "")
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


def load_in_ort(path: Path) -> dict[str, Any]:
    """Whether ONNX Runtime (CPU provider) accepts the file: an ``InferenceSession`` is actually created.

    Returns ``{"ort_loads": True, "session": session}``, or ``{"ort_loads": False, "ort_error": text}`` with
    ONNX Runtime's refusal (e.g. onnxconverter-common's "Type (tensor(float16)) of output arg ... does not
    match expected type (tensor(float))" when a graph output is also read inside the graph).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        return {"ort_loads": False, "ort_error": one_line(exc)}
    return {"ort_loads": True, "session": session}


def run_ort(path: Path, inputs: tuple[tuple, dict], reference: Any, *, logits: bool, time_it: bool) -> dict[str, Any]:
    """Load ``path`` in ONNX Runtime (CPU), score its first output against ``reference`` and time it.

    The result holds ``ort_loads`` (see :func:`load_in_ort`), and ``ort_error`` (the refusal text) when
    the session cannot be created or run.
    """
    loaded = load_in_ort(path)
    if not loaded["ort_loads"]:
        return loaded
    session = loaded.pop("session")
    try:
        feed = onnx_feed(session, inputs)
        outputs = session.run(None, feed)
    except Exception as exc:
        return loaded | {"ort_error": one_line(exc)}
    first = torch.from_numpy(np.asarray(outputs[0]).astype(np.float32))
    result: dict[str, Any] = loaded | {"accuracy": accuracy(reference, first, logits=logits)}
    result["accuracy"]["nonfinite"] = sum(int((~np.isfinite(o)).sum()) for o in outputs if o.dtype.kind == "f")
    if time_it:
        result["latency"] = latency(lambda: session.run(None, feed))
    return result


#: ONNX op types that amplite's FP32 groups (``amplite.op_tables.FP32_OPS``: reductions, softmax, norms,
#: losses, transcendental functions, upsampling) become in a ``torch.onnx`` export. Elementwise arithmetic
#: (Add, Mul, Where, ...) is not among them: amplite keeps single nodes of it in FP32 (O1's residual adds,
#: the parts of a decomposed norm), and blocking an op type in onnxconverter-common blocks every node of it.
FP32_GROUP_OPS = frozenset({
    "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare", "CumSum",
    "LayerNormalization", "GroupNormalization", "InstanceNormalization", "BatchNormalization", "RMSNormalization",
    "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Acos", "Asin", "Cosh", "Sinh", "Tan", "Softplus",
    "Resize", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
})


def fp32_ops(path: Path) -> dict[str, int]:
    """Op types (with node counts) that compute in FP32 in an ONNX file: every float input and output is
    float32. Casts, constants and shape ops are left out."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    graph = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.output, *graph.value_info]}
    types |= {init.name: init.data_type for init in graph.initializer}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in ("Cast", "CastLike", "Constant", "Shape", "Size"):
            continue
        seen = [types.get(v) for v in [*node.input, *node.output] if types.get(v) in floats]
        if seen and all(t == onnx.TensorProto.FLOAT for t in seen):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def onnxconverter_common_fp16(fp32_path: Path, path: Path, op_block_list: list[str] | None = None) -> dict[str, Any]:
    """``convert_float_to_float16(keep_io_types=True)`` on the FP32 export: seconds, bytes, casts, checker.

    ``op_block_list``: op types kept in FP32 on top of onnxconverter-common's default block list (None: its
    default alone).
    """
    import onnx
    from onnxconverter_common import float16

    blocked = None if op_block_list is None else sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(op_block_list))
    start = perf_counter()
    with quiet():
        converted = float16.convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True,
                                                     op_block_list=blocked)
    seconds = perf_counter() - start
    onnx.save(converted, str(path))
    result: dict[str, Any] = {"convert_s": seconds, "bytes": file_bytes(path), "casts": count_casts(path)}
    try:
        onnx.checker.check_model(str(path), full_check=True)
        result["checker"] = "passed"
    except Exception as exc:
        result["checker"] = one_line(exc)
    return result


def occ_same_fp32_ops(model: torch.nn.Module, inputs: tuple[tuple, dict], work: Path, amplite_fp32_ops: dict[str, int],
                      reference: Any, *, logits: bool) -> dict[str, Any]:
    """onnxconverter-common keeping in FP32 the op types amplite's ONNX file keeps in FP32 (of
    :data:`FP32_GROUP_OPS`): the FP32 dynamo export of ``model``, converted, counted and run in ONNX Runtime.

    ``amplite_fp32_ops``: :func:`fp32_ops` of amplite's file of the same configuration.
    """
    blocked = sorted(op for op in amplite_fp32_ops if op in FP32_GROUP_OPS)
    fp32, path = work / "fp32_for_occ.onnx", work / "occ_same.onnx"
    export_fp32(model, inputs, fp32)
    res = onnxconverter_common_fp16(fp32, path, op_block_list=blocked) | {"blocked": blocked}
    return res | run_ort(path, inputs, reference, logits=logits, time_it=False)


def amplite_onnx(program: Any, path: Path, precision: str) -> dict[str, Any]:
    """amplite's ONNX output of a converted program (``amplite.onnx.export.save_onnx``)."""
    from amplite.onnx.export import save_onnx

    start = perf_counter()
    with quiet():
        info = save_onnx(program, path, precision=precision)
    return {"export_s": perf_counter() - start, "bytes": info.bytes, "casts": count_casts(path),
            "casts_amplite": info.casts, "checker": info.checker, "cleanup": info.cleanup, "fp32_ops": fp32_ops(path)}
