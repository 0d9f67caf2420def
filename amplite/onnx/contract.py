"""``amplite::contract`` in ONNX: the ``amplite.Contract``/``ContractBias`` nodes and their function bodies.

The translation (:func:`contract_translation`, registered with the exporter by ``export``) records a plain node
of the ``amplite`` domain (version 1), whose schema is not in onnx's global registry, so the exporter does
not inline it; :func:`contract_functions` are the model-local bodies attached afterwards (Cast → Einsum →
scale/bias → Cast, FP32 inside), so every runtime can run the node while a runtime with a kernel registered
for the domain claims it instead.
"""

from __future__ import annotations

from typing import Any

import onnx
import onnx.parser
import onnx_ir as ir
from onnx import defs, helper
from onnxscript.values import Op, Opset

DOMAIN = "amplite"
DOMAIN_VERSION = 1
#: The function bodies use CastLike (opset 15).
MIN_OPSET_CONTRACT = 15


def _schema(name: str, bias: bool) -> defs.OpSchema:
    fp = defs.OpSchema.FormalParameter
    attr = defs.OpSchema.Attribute
    inputs = [fp("A", "T"), fp("B", "T")] + ([fp("C", "T")] if bias else [])
    attrs = [attr("equation", defs.OpSchema.AttrType.STRING, "binary einsum equation"),
             attr("alpha", helper.make_attribute("alpha", 1.0), "scale of the contraction")]
    if bias:
        attrs.append(attr("beta", helper.make_attribute("beta", 1.0), "scale of C"))
    types = ["tensor(float16)", "tensor(bfloat16)", "tensor(float)", "tensor(double)"]
    return defs.OpSchema(name, DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=[fp("Y", "T")],
                         type_constraints=[("T", types, "")], attributes=attrs)


# Ops with a schema that is NOT registered in onnx's global registry: calling them records a plain node.
_OPSET = Opset(DOMAIN, DOMAIN_VERSION)
_CONTRACT = Op(_OPSET, "Contract", _schema("Contract", bias=False))
_CONTRACT_BIAS = Op(_OPSET, "ContractBias", _schema("ContractBias", bias=True))


def contract_translation(equation: str, a: Any, b: Any, c: Any = None, alpha: float = 1.0, beta: float = 1.0):
    """ONNX translation of ``amplite::contract``: an ``amplite.Contract``/``ContractBias`` node."""
    if c is None or beta == 0.0:
        return _CONTRACT(a, b, equation=equation, alpha=float(alpha))
    return _CONTRACT_BIAS(a, b, c, equation=equation, alpha=float(alpha), beta=float(beta))


_BODY = """
<domain: "amplite", opset_import: ["" : {opset}]>
{name} <equation, alpha: float = 1.0{beta_attr}> (A, B{c_in}) => (Y) {{
    a32 = Cast<to = 1>(A)
    b32 = Cast<to = 1>(B)
    y = Einsum<equation: string = @equation>(a32, b32)
    alpha_t = Constant<value_float: float = @alpha>()
    ys = Mul(y, alpha_t){bias}
    Y = CastLike({result}, A)
}}
"""
_BIAS = """
    c32 = Cast<to = 1>(C)
    beta_t = Constant<value_float: float = @beta>()
    cs = Mul(c32, beta_t)
    z = Add(ys, cs)"""


def contract_functions(opset: int) -> list[ir.Function]:
    """Model-local bodies of ``amplite.Contract``/``ContractBias``: FP32 einsum, scale, bias, cast back."""
    texts = [_BODY.format(opset=opset, name="Contract", beta_attr="", c_in="", bias="", result="ys"),
             _BODY.format(opset=opset, name="ContractBias", beta_attr=", beta: float = 1.0", c_in=", C",
                          bias=_BIAS, result="z")]
    return [ir.serde.deserialize_function(onnx.parser.parse_function(t)) for t in texts]
