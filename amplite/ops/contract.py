"""``amplite::contract``: one binary tensor contraction with scaling and bias, backed by cuTENSOR.

``contract(equation, a, b, c, alpha, beta) = alpha * einsum(equation, a, b) + beta * c``

* ``equation`` is an explicit binary einsum expression (``"bhqd,bhkd->bhqk"``): letters only, each letter
  at most once per operand, every output letter present in ``a`` or ``b``. A letter in only one input and
  not in the output is summed over; a letter in the output and only one input broadcasts over the other.
* ``a`` and ``b`` share one floating dtype (fp16 or bf16 in converted graphs); accumulation is FP32 and the
  result has the operands' dtype. ``c`` (optional) has that dtype too and broadcasts to the output
  (right-aligned, like ``torch.add``).
* The result is a fresh contiguous tensor; inputs may have any strides, so permuted or transposed
  views are consumed without being copied.

The op is registered (with a fake implementation and autograd) when this module is imported, which
``import amplite`` / ``import amplite.ops`` does: a ``.pt2`` saved with the op loads with
``torch.export.load`` only after that import.

Numerics, identical in every backend: products accumulated in FP32, ``alpha`` and ``beta * c`` applied
in FP32, and one rounding to the operands' dtype at the end (so a product that overflows fp16 but is
scaled back into range by ``alpha`` stays finite, as with cuTENSOR).

Backends, chosen at run time per call (:func:`active_backend`):

* ``"cutensor"``: CUDA tensors, with nvmath-python 1.x installed (``pip install amplite[cutensor]``) and
  cuTENSOR passing a real probe on that device and dtype (``cutensor_backend.probe``). Any failure, at
  the probe or on a later call, falls back to ``"torch"`` with the reason logged once.
* ``"torch"``: one ``bmm``/``baddbmm`` on permute/reshape views of the operands in their own dtype
  (:mod:`amplite.ops.gemm_lowering`): the GEMM accumulates in FP32, applies ``alpha``/``beta`` in FP32 and
  rounds once, so it keeps the numerics above at the cost of the unfused graph's own GEMM, never more.

``AMPLITE_CONTRACT_BACKEND=cutensor|torch`` overrides the choice for CUDA tensors (``cutensor`` fails loudly,
with the probe's reason, when cuTENSOR is unusable). CPU tensors always use ``"torch"``: cuTENSOR has no
CPU path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from amplite.ops import cutensor_backend
from amplite.ops.gemm_lowering import gemm_contract

ENV_BACKEND = "AMPLITE_CONTRACT_BACKEND"
BACKENDS = ("cutensor", "torch")
#: How the ``torch`` backend computes, for the report's ``contract_backend`` line.
FALLBACK = "bmm/baddbmm on the operands' dtype, FP32 accumulation"


@functools.lru_cache(maxsize=1024)
def parse_equation(equation: str) -> tuple[str, str, str]:
    """Split and validate a binary einsum equation.

    Args:
        equation: ``"<a>,<b>-><out>"`` with ASCII letters only.

    Returns:
        The subscripts of ``a``, ``b`` and the output.

    Raises:
        ValueError: If the equation is not an explicit binary einsum the op supports.
    """
    eq = equation.replace(" ", "")
    if "->" not in eq or eq.count(",") != 1 or "." in eq:
        raise ValueError(f"contract needs an explicit binary einsum 'ab,bc->ac', got {equation!r}")
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    for name, subs in (("a", a), ("b", b), ("output", out)):
        if not all(ch.isascii() and ch.isalpha() for ch in subs):
            raise ValueError(f"contract: subscripts of {name} must be letters, got {subs!r}")
        if len(set(subs)) != len(subs):
            raise ValueError(f"contract: a letter repeats within {name} ({subs!r}); diagonals unsupported")
    missing = set(out) - set(a) - set(b)
    if missing:
        raise ValueError(f"contract: output letters {sorted(missing)} appear in no input of {equation!r}")
    return a, b, out


def output_shape(equation: str, a_shape: Sequence[int], b_shape: Sequence[int]) -> list[int]:
    """The result shape of ``equation`` on operands of the given shapes (validating that they agree)."""
    sa, sb, so = parse_equation(equation)
    if len(sa) != len(a_shape) or len(sb) != len(b_shape):
        raise ValueError(
            f"contract: {equation!r} does not match operand ranks {len(a_shape)} and {len(b_shape)}"
        )
    sizes: dict[str, int] = {}
    for subs, shape in ((sa, a_shape), (sb, b_shape)):
        for ch, n in zip(subs, shape, strict=True):
            if sizes.setdefault(ch, n) != n:
                raise ValueError(f"contract: mode {ch!r} has sizes {sizes[ch]} and {n} in {equation!r}")
    return [sizes[ch] for ch in so]


def _check(equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None) -> list[int]:
    shape = output_shape(equation, a.shape, b.shape)
    if a.dtype != b.dtype or (c is not None and c.dtype != a.dtype):
        # cuTENSOR needs one dtype for A, B, C and D; mixing would silently change the semantics.
        dts = (a.dtype, b.dtype, None if c is None else c.dtype)
        raise TypeError(f"contract: a, b and c must share one dtype, got {dts}")
    if not a.dtype.is_floating_point:
        raise TypeError(f"contract: floating operands required, got {a.dtype}")
    if c is not None:
        try:
            ok = torch.broadcast_shapes(c.shape, shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"contract: c of shape {tuple(c.shape)} does not broadcast to {tuple(shape)}")
    return shape


def active_backend(device: torch.device | str, dtype: torch.dtype = torch.float16) -> str:
    """The backend :func:`contract` uses for ``dtype`` tensors on ``device``: ``"cutensor"`` or ``"torch"``.

    Raises:
        ValueError: If ``AMPLITE_CONTRACT_BACKEND`` holds an unknown name.
        RuntimeError: If it asks for ``cutensor`` on CUDA but the cuTENSOR probe failed (with its reason).
    """
    device = torch.device(device)
    forced = os.environ.get(ENV_BACKEND, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={forced!r}; expected one of {BACKENDS}")
    if device.type != "cuda" or forced == "torch":
        return "torch"
    verdict = cutensor_backend.probe(device, dtype)
    if verdict.ok:
        return "cutensor"
    if forced == "cutensor":
        raise RuntimeError(f"{ENV_BACKEND}=cutensor but cuTENSOR is unusable: {verdict.reason}")
    return "torch"


def backend_description(device: torch.device | str) -> str:
    """The report's ``contract_backend`` line, e.g. ``"cutensor (nvmath-python 1.0.0, cuTENSOR 2.3.1)"``.

    On CUDA it probes fp16 and bf16; a fallback names its reason.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"torch: {FALLBACK} (CPU)"
    if os.environ.get(ENV_BACKEND, "").strip().lower() == "torch":
        return f"torch: {FALLBACK} (CUDA; {ENV_BACKEND}=torch)"
    verdicts = {dt: cutensor_backend.probe(device, dt) for dt in (torch.float16, torch.bfloat16)}
    ok = [str(dt).removeprefix("torch.") for dt, v in verdicts.items() if v.ok]
    failed = {str(dt).removeprefix("torch."): v.reason for dt, v in verdicts.items() if not v.ok}
    versions = f"nvmath-python {cutensor_backend.nvmath_version()}, cuTENSOR {cutensor_backend.cutensor_version()}"
    if not failed:
        return f"cutensor ({versions})"
    why = "; ".join(f"{k}: {r}" for k, r in failed.items())
    if ok:
        return f"cutensor for {', '.join(ok)} ({versions}); torch fallback ({FALLBACK}) for {why}"
    return f"torch: {FALLBACK} (CUDA; cuTENSOR unusable: {why})"


def torch_contract(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    """The ``torch`` backend: one GEMM in the operands' dtype (:func:`gemm_lowering.gemm_contract`).

    FP32 accumulation, scaling and bias inside the GEMM, one rounding at the end, on every device, with no
    FP32 copy of the operands. Also the decomposition AOTInductor packages (``deploy/aoti.py``).
    """
    return gemm_contract(equation, a, b, c, alpha, beta)


def reference_contract(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    """The semantics spelled out: ``torch.einsum`` on FP32-upcast operands, one cast back (tests, probes)."""
    dtype = a.dtype
    wide = torch.promote_types(dtype, torch.float32)  # fp16/bf16 -> fp32; fp64 stays fp64
    out = torch.einsum(equation, a.to(wide), b.to(wide))
    if alpha != 1.0:
        out = out * alpha
    if c is not None and beta != 0.0:
        out = out + beta * c.to(wide)
    return out.to(dtype).contiguous()


@torch.library.custom_op("amplite::contract", mutates_args=())
def contract(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    """``alpha * einsum(equation, a, b) + beta * c`` with FP32 accumulation (see the module docstring)."""
    _check(equation, a, b, c)
    if active_backend(a.device, a.dtype) == "cutensor":
        out = cutensor_backend.contract(equation, a, b, c, alpha, beta)
        if out is not None:
            return out
    return torch_contract(equation, a, b, c, alpha, beta)


@contract.register_fake
def _contract_fake(
    equation: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    return a.new_empty(_check(equation, a, b, c))


def _grad_operand(
    g: torch.Tensor,
    g_subs: str,
    other: torch.Tensor,
    other_subs: str,
    target_subs: str,
    target_shape,
    alpha: float,
) -> torch.Tensor:
    """Gradient of one input: contract the output gradient with the other input (one contraction)."""
    # Letters of the target summed alone in the forward pass (in neither g nor other) cannot be output
    # letters of an einsum; their gradient is the same along them, so compute without and broadcast.
    present = set(g_subs) | set(other_subs)
    reduced = "".join(ch for ch in target_subs if ch in present)
    grad = contract(f"{g_subs},{other_subs}->{reduced}", g, other, None, alpha, 0.0)
    if reduced != target_subs:
        view = [target_shape[i] if ch in present else 1 for i, ch in enumerate(target_subs)]
        grad = grad.reshape(view).expand(target_shape)
    return grad


def _setup_context(ctx, inputs, output) -> None:
    equation, a, b, c, alpha, beta = inputs
    ctx.save_for_backward(a, b)
    ctx.equation, ctx.alpha, ctx.beta = equation, alpha, beta
    ctx.c_shape = None if c is None else tuple(c.shape)


def _backward(ctx, grad: torch.Tensor):
    a, b = ctx.saved_tensors
    sa, sb, so = parse_equation(ctx.equation)
    grad = grad.to(a.dtype)
    da = db = dc = None
    if ctx.needs_input_grad[1]:
        da = _grad_operand(grad, so, b, sb, sa, a.shape, ctx.alpha)
    if ctx.needs_input_grad[2]:
        db = _grad_operand(grad, so, a, sa, sb, b.shape, ctx.alpha)
    if ctx.c_shape is not None and ctx.needs_input_grad[3]:
        dc = grad.to(torch.promote_types(a.dtype, torch.float32)) * ctx.beta
        # Sum over the dimensions that broadcasting added or expanded.
        lead = dc.dim() - len(ctx.c_shape)
        dims = list(range(lead)) + [
            lead + i for i, n in enumerate(ctx.c_shape) if n == 1 and dc.shape[lead + i] != 1
        ]
        if dims:
            dc = dc.sum(dim=dims, keepdim=True)
        dc = dc.reshape(ctx.c_shape).to(a.dtype)
    return None, da, db, dc, None, None


contract.register_autograd(_backward, setup_context=_setup_context)
