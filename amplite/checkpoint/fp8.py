"""FP8 checkpoint directories (``amplite convert DIR --precision fp8``) in the layout vLLM's ``fp8`` method reads.

The decoder blocks' linear weights are stored as ``float8_e4m3fn`` with one FP32 ``weight_scale`` per tensor
(vLLM's ``Fp8LinearMethod`` loads a per-tensor scale for a serialized checkpoint without
``weight_block_size``), and, with calibration data, an FP32 ``input_scale`` per linear (``activation_scheme:
"static"``); without it ``activation_scheme: "dynamic"``. Embeddings, the LM head, norms and any linear
outside the decoder blocks stay bf16 and are listed in ``ignored_layers``. Scales follow
:mod:`amplite.ops.fp8_numerics` (``scale = amax / 448``; ``x ~= q * scale``).

Read back (:class:`Fp8Reader`): every FP8 weight is dequantized with its scale, and the linear inputs are
quantized with the stored ``input_scale`` (static) or per token (dynamic, as vLLM does on GPUs with CUTLASS
FP8 kernels), so verification measures what a server computes, on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch import nn

from amplite.checkpoint.blockwise import _BLOCK, _Streaming, flat_inputs, runnable_module
from amplite.checkpoint.keys import KeyMap
from amplite.checkpoint.source import PREFIX, Checkpoint, TensorInfo, load_tensor
from amplite.errors import ConfigError, LoadError
from amplite.levels import FP8, split_precision
from amplite.ops.fp8_numerics import (
    FP8_DTYPE,
    dequantize,
    quantize,
    quantize_dynamic_per_token,
    quantize_weight,
    scale_from_amax,
)
from amplite.options import ConvertOptions
from amplite.passes.graph_utils import cast_dtype
from amplite.report.sections import Fp8Checkpoint

STATIC, DYNAMIC = "static", "dynamic"
#: What the written ``config.json`` says (vLLM ``Fp8Config.from_config`` keys; transformers reads the same ones).
QUANT_METHOD = "fp8"
Entry = tuple[str, torch.dtype, tuple[int, ...]]
#: How verification runs the written directory on the CPU (no FP8 kernels here), by activation scheme.
READ_BACK = {
    STATIC: "weights dequantized with weight_scale; each FP8 linear's input quantized to e4m3 with its input_scale",
    DYNAMIC: "weights dequantized with weight_scale; each FP8 linear's input quantized to e4m3 per token",
}


def split_fp8(opts: ConvertOptions) -> tuple[ConvertOptions, Fp8Request | None]:
    """``precision="fp8"`` for a checkpoint directory: the options of the bf16 plan it builds on (calibration
    taken out: it feeds the activation scales here, not the range rules), and the FP8 request."""
    if not isinstance(opts.precision, str) or not split_precision(opts.precision)[1]:
        return opts, None
    return replace(opts, precision="bf16", calibration=None), Fp8Request(opts.calibration)


@dataclass(frozen=True)
class Fp8Request:
    """What ``--precision fp8`` asked for: calibration batches (``--calib``/``--calib-loader``) or None (dynamic)."""

    calibration: Any = None


def refuse_quantized(ckpt: Checkpoint) -> None:
    """A source that is already quantized is refused: its stored values are not the model's weights.

    Raises:
        ConfigError: ``config.json`` has a ``quantization_config``.
    """
    qc = ckpt.config.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ConfigError(f"{ckpt.path / 'config.json'} has a quantization_config (quant_method {method!r}): the "
                          "checkpoint is already quantized", "convert the full-precision (FP32/bf16/fp16) checkpoint "
                          "it was made from")  # fmt: skip


@dataclass
class Fp8Plan:
    """Which shard tensors are stored FP8 and how.

    Attributes:
        linears: Shard weight name -> its layer's name in the checkpoint (``model.layers.0.mlp.up_proj``).
        program: Program weight name (``lm.model...weight``) -> shard weight name, for the FP8 linears.
        ignored: Layers left bf16 (``ignored_layers``): embeddings, the LM head, linears outside the blocks.
        scheme: ``static`` (an ``input_scale`` per linear, from calibration) or ``dynamic``.
        input_amax: Shard weight name -> max |input| over the calibration tokens (static).
        calibration: ``{"batches", "tokens"}`` of the calibration run (static).
    """

    linears: dict[str, str]
    program: dict[str, str]
    ignored: list[str]
    scheme: str = DYNAMIC
    input_amax: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, int] = field(default_factory=dict)

    def quantization_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``: vLLM's keys, plus transformers' spelling of the skip list."""
        return {"quant_method": QUANT_METHOD, "activation_scheme": self.scheme, "ignored_layers": list(self.ignored),
                "modules_to_not_convert": list(self.ignored), "weight_block_size": None,
                "amplite": {"weight_scale": "per-tensor, amax/448, float32",
                            "input_scale": "per-tensor, calibrated amax/448, float32" if self.scheme == STATIC
                            else None}}  # fmt: skip

    def entries(self, info: TensorInfo, dtype: torch.dtype) -> list[Entry]:
        """The tensors written for shard tensor ``info`` (name, dtype, shape): an FP8 weight and its scales."""
        layer = self.linears.get(info.name)
        if layer is None:
            return [(info.name, dtype, info.shape)]
        out = [(info.name, FP8_DTYPE, info.shape), (f"{layer}.weight_scale", torch.float32, ())]
        return out + ([(f"{layer}.input_scale", torch.float32, ())] if self.scheme == STATIC else [])

    def tensors(self, info: TensorInfo, t: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The values of :meth:`entries`, from the source tensor ``t``."""
        if info.name not in self.linears:
            return [t if t.dtype == dtype or not t.dtype.is_floating_point else t.to(dtype)]
        q, scale = quantize_weight(t, per_channel=False)
        out = [q, scale.reshape(())]
        if self.scheme == STATIC:
            out.append(scale_from_amax(self.input_amax[info.name]).reshape(()))
        return out


def plan_fp8(keys: KeyMap, lm: nn.Module) -> Fp8Plan:
    """The decoder blocks' ``nn.Linear`` weights that one shard tensor holds as is become FP8; every other linear
    and every embedding is an ignored layer (named as in the checkpoint where it is stored under its own name).

    Raises:
        ConfigError: A mixture-of-experts model (vLLM would read its experts as FP8 too), or no such linear.
    """
    moe = next((type(m).__name__ for m in lm.modules() if type(m).__name__.endswith(("Experts", "SparseMoeBlock"))),
               None)  # fmt: skip
    if moe is not None:
        raise ConfigError(f"FP8 checkpoints of mixture-of-experts models ({moe}) are not supported yet: vLLM's "
                          "fp8 method expects FP8 experts with their own scales", "convert it with --precision bf16")
    linears, program, ignored = {}, {}, []
    for path, mod in lm.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        src = keys.sources.get(f"{path}.weight")
        shard = src.keys[0][0] if src is not None and src.converter is None and len(src.keys) == 1 else None
        name = shard.removesuffix(".weight") if shard is not None and shard.endswith(".weight") else path
        if isinstance(mod, nn.Linear) and shard is not None and name != shard and _BLOCK.match(path + "."):
            linears[shard] = name
            program[f"{PREFIX}{path}.weight"] = shard
        else:
            ignored.append(name)
    if not linears:
        raise ConfigError("no linear layer of a decoder block is stored as one tensor in this checkpoint: nothing "
                          "to store in FP8", "convert it with --precision bf16")  # fmt: skip
    return Fp8Plan(linears, program, ignored)


def linear_weight(node: torch.fx.Node) -> str | None:
    """The weight name (``get_attr`` target, through pure casts) of an ``aten.linear`` node, else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default or len(node.args) < 2:
        return None
    w = node.args[1]
    while isinstance(w, torch.fx.Node) and cast_dtype(w) is not None:
        w = w.args[0]
    return str(w.target) if isinstance(w, torch.fx.Node) and w.op == "get_attr" else None


def calibrate(plan: Fp8Plan, program: Any, load: Callable[[str], torch.Tensor], batches: Iterable[Any]) -> Fp8Plan:
    """Run the FP32 source block by block (each weight loaded before its first use) on each calibration batch and
    record max |input| of every FP8 linear: the static ``input_scale`` is that amax / 448.

    Raises:
        ConfigError: No batch, or a batch whose shapes differ from the traced ones.
    """
    amax: dict[str, float] = {}

    def record(node: torch.fx.Node, args: tuple[Any, ...]) -> tuple[Any, ...]:
        shard = plan.program.get(linear_weight(node) or "")
        if shard is not None:
            amax[shard] = max(amax.get(shard, 0.0), float(args[0].detach().abs().max()))
        return args

    gm = runnable_module(program)
    traced = [tuple(t.shape) for t in flat_inputs(program, program.example_inputs) if isinstance(t, torch.Tensor)]
    count = tokens = 0
    with torch.no_grad():
        for batch in batches:
            flat = flat_inputs(program, batch)
            shapes = [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]
            if shapes != traced:
                raise ConfigError(f"calibration batch {count} has input shapes {shapes}, the trace {traced}",
                                  "give calibration batches of one shape (the first one is traced)")  # fmt: skip
            _Streaming(gm, load, hook=record).run(*flat)
            count += 1
            tokens += math.prod(shapes[0]) if shapes else 0
    if not count:
        raise ConfigError("the calibration source holds no batch", "give at least one batch to --calib")
    missing = [s for s in plan.linears if s not in amax]
    if missing:
        raise ConfigError(f"calibration never ran linear {missing[0]}: its input_scale is unknown",
                          "calibrate on inputs that run every decoder block")  # fmt: skip
    return replace(plan, scheme=STATIC, input_amax=amax, calibration={"batches": count, "tokens": tokens})


class Fp8Reader:
    """An FP8 directory amplite wrote, read back: dequantized weights, the activation quantization it implies.

    Raises:
        LoadError: No fp8 ``quantization_config``, or an FP8 weight without its ``weight_scale``
            (``input_scale`` for the static scheme).
    """

    def __init__(self, ckpt: Checkpoint) -> None:
        qc = ckpt.config.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
            raise LoadError(f"{ckpt.path} is not an FP8 checkpoint (no quantization_config with quant_method fp8)",
                            "point at a directory written by `amplite convert DIR --precision fp8`")  # fmt: skip
        self.ckpt = ckpt
        self.scheme = str(qc.get("activation_scheme", DYNAMIC))
        self.layers = {n: n.removesuffix(".weight") for n, i in ckpt.tensors.items() if i.dtype == FP8_DTYPE}
        for name, layer in self.layers.items():
            for need in ("weight_scale", *(["input_scale"] if self.scheme == STATIC else [])):
                if f"{layer}.{need}" not in ckpt.tensors:
                    raise LoadError(f"{ckpt.path}: FP8 weight {name} has no {layer}.{need}",
                                    "rewrite the directory with amplite convert --precision fp8")  # fmt: skip

    @property
    def precision(self) -> str:
        """The precision name the directory was converted with."""
        return FP8

    def tensor(self, name: str) -> torch.Tensor:
        """Shard tensor ``name`` as a full-precision value: an FP8 weight dequantized (FP32), others as stored."""
        t = load_tensor(self.ckpt.tensors[name])
        layer = self.layers.get(name)
        return t if layer is None else dequantize(t, load_tensor(self.ckpt.tensors[f"{layer}.weight_scale"]))

    def input_scale(self, name: str) -> torch.Tensor | None:
        """The static ``input_scale`` of FP8 weight ``name`` (None: dynamic scheme or not an FP8 weight)."""
        layer = self.layers.get(name)
        if layer is None or self.scheme != STATIC:
            return None
        return load_tensor(self.ckpt.tensors[f"{layer}.input_scale"])

    def quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the FP8 linear of weight ``name`` sees it: quantized with its ``input_scale`` (static) or per
        token (dynamic), dequantized back to ``x``'s dtype; ``x`` unchanged for a weight that is not FP8."""
        if name not in self.layers:
            return x
        scale = self.input_scale(name)
        if scale is not None:
            return dequantize(quantize(x, scale), scale, x.dtype)
        q, s = quantize_dynamic_per_token(x)
        return dequantize(q, s, x.dtype)


def fake_quant_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 with one dynamic scale for the whole tensor (vLLM's on-the-fly ``--quantization fp8``
    without per-token kernels): the baseline the calibrated scales are compared with."""
    scale = scale_from_amax(x.detach().abs().amax())
    return dequantize(quantize(x, scale), scale, x.dtype)


def fp8_section(plan: Fp8Plan, ckpt: Checkpoint) -> Fp8Checkpoint:
    """The report's ``fp8_checkpoint`` section from the plan and the source's tensor metadata (bytes as written,
    scales included, against every floating tensor in bf16)."""
    written = bf16 = 0
    for info in ckpt.tensors.values():
        n = math.prod(info.shape)
        low = 2 if info.dtype.is_floating_point and info.dtype.itemsize >= 2 else info.dtype.itemsize
        bf16 += n * low
        written += sum(math.prod(s) * d.itemsize for _, d, s in plan.entries(info, torch.bfloat16)) \
            if info.name in plan.linears else n * low  # fmt: skip
    return Fp8Checkpoint.from_json({"layout": "vLLM quant_method fp8 (safetensors)", "activation_scheme": plan.scheme,
                          "weight_scales": "per-tensor", "fp8_linears": len(plan.linears),
                          "ignored_layers": plan.ignored, "calibration": plan.calibration or None, "bytes": written,
                          "bf16_bytes": bf16, "size_vs_bf16": round(written / max(bf16, 1), 4),
                          "verified_as": READ_BACK[plan.scheme]})  # fmt: skip
