"""Verification of a written ``.onnx`` in ONNX Runtime, with the same metrics as the torch verification.

The provider is CUDAExecutionProvider when ONNX Runtime has it and a CUDA device is present, else
CPUExecutionProvider. The report says which provider actually ran. ONNX Runtime's CPU provider has fp16
kernels for almost nothing: it inserts Cast→FP32 kernel→Cast around such nodes and fuses them with the
model's own casts, so CPU numbers do not show fp16 rounding (the ``caveat`` says so). A model a provider
cannot run (bf16 on CPU: no kernels at all) is not a crash: the result is ``runnable=False`` with
``not_runnable`` naming the ops, found by trying each distinct (op, input types) of the inlined graph in a
one-node session.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import onnx
import onnx.inliner
import torch
from torch.utils import _pytree as pytree

from amplite.verify.compare import OutputMetrics, Tolerance, output_names, tensor_metrics

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU_CAVEAT = (
    "ONNX Runtime's CPUExecutionProvider has no fp16 kernels for most ops: it computes them in FP32 through "
    "inserted casts and fuses those with the model's own casts, so these results do not reflect fp16 rounding "
    "(verify on CUDAExecutionProvider for that)"
)
_TORCH_DTYPES = {
    "tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64,
}


@dataclass
class OnnxVerification:
    """Result of running a ``.onnx`` in ONNX Runtime against the FP32 reference outputs.

    Attributes:
        path: The model file.
        provider: The provider that ran the model (or that could not run it).
        providers_requested: The providers asked for, in order.
        runnable: False when the provider has no kernel for some node.
        not_runnable: ``"not runnable on <provider>: <ops>"`` when ``runnable`` is False.
        unsupported_ops: ``Op(dtype, ...)`` entries with no kernel on the provider.
        caveat: Why the numbers may not reflect the low precision (CPU provider with fp16).
        metrics: Per-output metrics (``amplite.verify.compare.OutputMetrics``).
        tolerance: The thresholds applied.
        seconds: Session creation plus run time.
        notes: Anything else worth knowing (a provider that failed to start, ...).
        outputs_match: False when the model returned a different number of outputs than the reference.
    """

    path: str
    provider: str
    providers_requested: list[str]
    runnable: bool = True
    not_runnable: str | None = None
    unsupported_ops: list[str] = field(default_factory=list)
    caveat: str | None = None
    metrics: list[OutputMetrics] = field(default_factory=list)
    tolerance: Tolerance | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    outputs_match: bool = True

    @property
    def passed(self) -> bool | None:
        """Verdict; None when the model could not run on the provider."""
        if not self.runnable:
            return None
        return self.outputs_match and all(m.passed for m in self.metrics)

    def to_dict(self) -> dict[str, Any]:
        """The ``verification_onnx`` entry of the report."""
        return {
            "runtime": "onnxruntime",
            "path": self.path,
            "provider": self.provider,
            "providers_requested": self.providers_requested,
            "runnable": self.runnable,
            "not_runnable": self.not_runnable,
            "unsupported_ops": self.unsupported_ops,
            "caveat": self.caveat,
            "passed": self.passed,
            "tolerance": vars(self.tolerance) if self.tolerance else None,
            "outputs": [m.to_dict() for m in self.metrics],
            "seconds": round(self.seconds, 4),
            "notes": self.notes,
        }


def choose_providers(provider: str | None = None) -> list[str]:
    """``[provider]`` (plus CPU fallback) if given; else CUDA when usable, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider is not None:
        return [provider] if provider == CPU else [provider, CPU]
    if CUDA in available and torch.cuda.is_available():
        return [CUDA, CPU]
    return [CPU]


def _session(model: str | bytes, providers: list[str]) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # provider start-up chatter goes to stderr otherwise
    return ort.InferenceSession(model, opts, providers=providers)


def _is_not_implemented(exc: BaseException) -> bool:
    return "NOT_IMPLEMENTED" in str(exc) or type(exc).__name__ == "NotImplemented"


def unsupported_ops(path: str | Path, providers: list[str]) -> list[str]:
    """Every distinct ``Op(input dtypes)`` of the (inlined) model with no kernel on ``providers``."""
    model = onnx.load(str(path), load_external_data=False)
    model = onnx.inliner.inline_local_functions(model)
    model = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    missing, tried = [], set()
    for node in model.graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        ins = [types.get(i, 0) if i else None for i in node.input]
        outs = [types.get(o, 0) for o in node.output]
        key = (node.domain, node.op_type, tuple(ins), tuple(a.SerializeToString() for a in node.attribute))
        if key in tried or 0 in ins or 0 in outs:
            continue
        tried.add(key)
        names = [f"i{k}" if i else "" for k, i in enumerate(node.input)]
        probe = onnx.helper.make_node(node.op_type, names, [f"o{k}" for k in range(len(node.output))],
                                      domain=node.domain)
        probe.attribute.extend(node.attribute)
        graph = onnx.helper.make_graph(
            [probe], "probe",
            [onnx.helper.make_tensor_value_info(n, t, None) for n, t in zip(names, ins, strict=True) if n],
            [onnx.helper.make_tensor_value_info(f"o{k}", t, None) for k, t in enumerate(outs)],
        )
        one = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
        try:
            _session(one.SerializeToString(), providers)
        except Exception as exc:
            if _is_not_implemented(exc):
                dts = sorted({onnx.helper.tensor_dtype_to_np_dtype(t).name if t != onnx.TensorProto.BFLOAT16
                              else "bfloat16" for t in ins if t})
                missing.append(f"{node.op_type}({', '.join(dts)})")
    return sorted(set(missing))


def _to_ort(x: torch.Tensor) -> Any:
    import onnxruntime as ort

    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            x.view(torch.uint16).numpy(), onnx_element_type=onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(x.numpy())


def _from_ort(value: Any) -> torch.Tensor:
    if value.element_type() == onnx.TensorProto.BFLOAT16:
        return torch.from_dlpack(value._get_c_value()).clone()
    return torch.from_numpy(value.numpy()).clone()


def _feeds(session: Any, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    """Session feeds: tensor leaves of ``(args, kwargs)`` in order, each in the dtype the graph declares."""
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    declared = session.get_inputs()
    if len(leaves) != len(declared):
        by_name = inputs[1]
        if not all(d.name in by_name for d in declared):
            raise ValueError(f"the ONNX model takes {len(declared)} inputs, the example inputs hold {len(leaves)}")
        leaves = [by_name[d.name] for d in declared]
    feeds = {}
    for d, x in zip(declared, leaves, strict=True):
        want = _TORCH_DTYPES.get(d.type)
        if want is not None and x.dtype.is_floating_point and x.dtype != want:
            x = x.to(want)
        feeds[d.name] = _to_ort(x)
    return feeds


def verify_onnx(
    path: str | Path,
    reference: Any,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    tolerance: Tolerance,
    *,
    provider: str | None = None,
) -> OnnxVerification:
    """Run ``path`` in ONNX Runtime on ``inputs`` and compare with the FP32 ``reference`` outputs.

    Args:
        path: A ``.onnx`` written by :func:`amplite.onnx.export.save_onnx`.
        reference: The FP32 model's outputs on ``inputs`` (any pytree; tensor leaves are compared in order).
        inputs: ``(args, kwargs)``; float inputs are cast to the dtype each graph input declares.
        tolerance: Pass thresholds (``amplite.verify.compare.DEFAULT_TOLERANCES[precision]``).
        provider: Force an execution provider (default: CUDA when usable, else CPU).

    Returns:
        The verification; ``runnable`` False (not an exception) when the provider lacks kernels.
    """
    providers = choose_providers(provider)
    result = OnnxVerification(str(path), providers[0], providers, tolerance=tolerance)
    start = perf_counter()
    try:
        session = _session(str(path), providers)
    except Exception as exc:
        if not _is_not_implemented(exc):
            raise
        ops = unsupported_ops(path, providers)
        if not ops:  # the probe found nothing: fall back to the op ORT named
            found = re.search(r"implementation for (\w+)\((\d+)\)", str(exc))
            ops = [found.group(1) if found else str(exc).splitlines()[0]]
        result.runnable = False
        result.unsupported_ops = ops
        result.not_runnable = f"not runnable on {providers[0]}: {', '.join(ops)}"
        result.seconds = perf_counter() - start
        return result
    used = session.get_providers()[0]
    if used != providers[0]:
        result.notes.append(f"{providers[0]} could not start; {used} ran the model")
    result.provider = used
    low_types = {"tensor(float16)", "tensor(bfloat16)"}
    model = onnx.load(str(path), load_external_data=False)
    if used == CPU and onnx.TensorProto.FLOAT16 in _elem_types(model):
        result.caveat = CPU_CAVEAT
    outputs = session.run_with_ort_values(None, _feeds(session, inputs))
    got = [_from_ort(v) for v in outputs]
    ref_leaves = pytree.tree_leaves(reference)
    refs = [(n, leaf) for n, leaf in zip(output_names(reference), ref_leaves, strict=True)
            if isinstance(leaf, torch.Tensor)]
    if len(refs) != len(got):
        result.outputs_match = False
        result.notes.append(f"the ONNX model returned {len(got)} outputs, the reference {len(refs)}")
    result.metrics = [tensor_metrics(n, r, o, tolerance) for (n, r), o in zip(refs, got, strict=False)]
    if any(o.type in low_types for o in session.get_outputs()):
        result.notes.append("outputs are in low precision (low-precision I/O)")
    result.seconds = perf_counter() - start
    return result


def _elem_types(model: onnx.ModelProto) -> set[int]:
    """Element types of the graph's inputs, outputs, typed intermediates and initializers."""
    vis = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    return {vi.type.tensor_type.elem_type for vi in vis} | {init.data_type for init in model.graph.initializer}
