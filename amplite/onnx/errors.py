"""One-line user errors for a failed ``torch.onnx.export``: the op or the innermost cause, named.

The exporter wraps every failure in a ``ConversionError`` whose first line only says which of its three
steps failed ("Failed to decompose the FX graph for ONNX compatibility. This is step 2/3 ... Next
steps:"). The cause is further down: in the exception chain (``__cause__``/``__context__``) and in the
message's "Exception summary" and "While executing %node ... target=<op>" lines. :func:`export_failure`
digs it out.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.errors import AmpliteError, ConfigError, ExportError

#: What the exporter's step N of 3 does ("This is step N/3 of exporting the model to ONNX").
STEPS = {1: "capturing the program", 2: "decomposing the graph", 3: "translating the graph to ONNX"}
#: Longest cause quoted in the one-line message.
CAUSE_LIMIT = 200
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PT2 = "save as .pt2 instead (--format pt2)"


def chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during, outermost first (cycles cut)."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _text(exc: BaseException) -> str:
    return _ANSI.sub("", str(exc))


def _shorten(text: str) -> str:
    return text if len(text) <= CAUSE_LIMIT else text[: CAUSE_LIMIT - 3] + "..."


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in _text(exc).splitlines() if ln.strip()]
    return _shorten(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)


def missing_ops(exc: BaseException) -> list[str]:
    """Names of ops the exporter found no ONNX translation for, from its exception chain (it stops at one)."""
    text = "\n".join(str(e) for e in chain(exc))
    found = re.findall(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>", text)
    return sorted({f"{op}.{overload}" for op, overload in found})


def scan_missing(program: ExportedProgram, table: dict[Any, Any]) -> list[str]:
    """Every op of ``program`` without an ONNX translation (private exporter API: best effort, [] on failure)."""
    try:
        from torch.onnx._internal.exporter import _fx_passes, _registration

        registry = _registration.ONNXRegistry.from_torchlib()
        decomposed = _fx_passes.decompose_with_registry(program, registry)
        return sorted({
            str(n.target) for n in decomposed.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target not in table and not registry.is_registered(n.target)
        })
    except Exception:  # the scan only improves the message; the exporter's own finding stands
        return []


def describe(exc: BaseException) -> tuple[str | None, str, str | None]:
    """``(step, cause, op)`` of an exporter failure.

    ``step`` is what the exporter was doing (None when it does not say), ``cause`` the first line of the
    innermost exception (``Type: message``, at most :data:`CAUSE_LIMIT` characters; the exporter's
    "Exception summary" when the chain ends at its own error), ``op`` the op of the node it was executing
    (``aten.view.default``), or None.
    """
    excs = chain(exc)
    text = "\n".join(_text(e) for e in excs)
    step_match = re.search(r"step (\d)/3 of exporting", text)
    step = STEPS.get(int(step_match.group(1))) if step_match else None
    op_match = re.search(r"While executing %\S+ : .*?target=(?:torch\.ops\.)?([\w.:]+)", text)
    inner = excs[-1]
    cause = _first_line(inner)
    summary = re.search(r"## Exception summary\s*\n\s*<class '(?:[\w.]+\.)?(\w+)'>: ([^\n]+)", _text(inner))
    if summary and len(excs) == 1:
        cause = _shorten(f"{summary.group(1)}: {summary.group(2).strip()}")
    return step, cause, op_match.group(1) if op_match else None


def _uses_sdpa(program: ExportedProgram) -> bool:
    return any(n.op == "call_function" and "scaled_dot_product" in str(n.target) for n in program.graph.nodes)


def export_failure(exc: BaseException, program: ExportedProgram, table: dict[Any, Any], opset: int) -> AmpliteError:
    """The one-line error for ``torch.onnx.export`` failing on ``program`` with ``exc``.

    An op without a translation is named (with every other such op of the program); an opset below 18
    is blamed on the opset; otherwise the message names the exporter's step and the innermost cause, and
    the fix suggests eager attention when a view failed in the decomposition of a program with
    ``scaled_dot_product_attention`` (the usual reason the decomposition re-traces a view it cannot take:
    the fused CPU kernels lay out their output differently from the decomposed op).
    """
    missing = missing_ops(exc)
    if missing:
        missing = sorted(set(missing) | set(scan_missing(program, table)))
        return ExportError(f"no ONNX translation for {', '.join(missing)}", _PT2)
    step, cause, op = describe(exc)
    if opset < 18:
        return ConfigError(f"the model cannot be exported at opset {opset}: {cause}",
                           "use --opset 18 or newer (default 20)")
    where = f" while {step}" if step else ""
    at = f" (at {op})" if op and op not in cause else ""
    fix = _PT2
    reshaped = bool(op and op.split(".")[1:2] in (["view"], ["_unsafe_view"], ["reshape"])) or "Cannot view" in cause
    if step == STEPS[2] and reshaped and _uses_sdpa(program):
        fix += ', or convert a model without scaled_dot_product_attention (e.g. attn_implementation="eager")'
    return ExportError(f"ONNX export failed{where}: {cause}{at}", fix)
