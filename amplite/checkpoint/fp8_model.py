"""An FP8 checkpoint directory as a runnable transformers model on the CPU (the generation check, the bench).

transformers cannot run this layout here: its ``fp8`` quantizer (``quantizers/quantizer_finegrained_fp8.py``)
dequantizes on a machine without FP8 kernels, but it reads DeepSeek's names (``weight_scale_inv``,
``activation_scale``), not vLLM's ``weight_scale``/``input_scale``, so it would load the e4m3 codes unscaled.
amplite therefore writes a bf16 copy with every FP8 weight dequantized (``q * weight_scale``, streamed shard by
shard into a temporary directory), loads that with ``from_pretrained`` in bf16 (what a server runs everything
but the FP8 matrix products in), and quantizes each FP8 linear's input as the server does: with its
``input_scale`` (static) or per token (dynamic), or per tensor (vLLM's on-the-fly baseline).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from amplite.checkpoint.fp8 import Fp8Reader, fake_quant_per_tensor
from amplite.checkpoint.source import INDEX, iter_shard, open_checkpoint
from amplite.errors import ConfigError

Activations = Literal["stored", "per-tensor", "none"]


def is_fp8_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a ``config.json`` with an ``fp8`` ``quantization_config``."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


def dequantized_copy(path: str | Path, dest: Path) -> Fp8Reader:
    """Write ``path``'s checkpoint to ``dest`` in bf16 with its FP8 weights dequantized and the scales dropped.

    Returns:
        The reader of ``path`` (its scales, for the activation hooks).
    """
    from safetensors.torch import save_file

    reader = Fp8Reader(open_checkpoint(path))
    scales = {f"{layer}.{s}" for layer in reader.layers.values() for s in ("weight_scale", "input_scale")}
    weight_map: dict[str, str] = {}
    for shard in reader.ckpt.shards:
        out: dict[str, torch.Tensor] = {}
        for name, t in iter_shard(shard):
            if name in scales:
                continue
            value = reader.tensor(name) if name in reader.layers else t
            out[name] = value.to(torch.bfloat16) if value.dtype.is_floating_point else value
            weight_map[name] = shard.name
        save_file(out, str(dest / shard.name), metadata={"format": "pt"})
        del out
    if (reader.ckpt.path / INDEX).exists():
        (dest / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {k: v for k, v in reader.ckpt.config.items() if k != "quantization_config"}
    (dest / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    return reader


def load_fp8_model(path: str | Path, activations: Activations = "stored") -> nn.Module:
    """The FP8 directory ``path`` as a bf16 ``AutoModelForCausalLM`` whose FP8 linears see e4m3 inputs.

    Args:
        path: A directory ``amplite convert DIR --precision fp8`` wrote.
        activations: ``stored``: the directory's scheme (static ``input_scale``, or dynamic per token);
            ``per-tensor``: one dynamic scale per tensor (vLLM's on-the-fly ``--quantization fp8`` baseline);
            ``none``: weight-only.

    Raises:
        ConfigError: transformers cannot build the model, or an FP8 layer is not a module of it.
    """
    import transformers

    with tempfile.TemporaryDirectory(prefix=".amplite-fp8.") as tmp:
        reader = dequantized_copy(path, Path(tmp))
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"transformers cannot load {path} (dequantized) as a causal LM: "
                              f"{str(exc).splitlines()[0]}", "check the directory with `amplite inspect DIR`") from None
    if activations == "none":
        return model
    for name, layer in reader.layers.items():
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            raise ConfigError(f"FP8 layer {layer} of {path} is not a module of {type(model).__name__}",
                              "the checkpoint's names must be the model's (transformers renames are not "
                              "supported for FP8 read-back yet)") from None  # fmt: skip

        def quantize_input(mod: nn.Module, args: tuple, name: str = name) -> tuple:
            x = args[0]
            return (fake_quant_per_tensor(x) if activations == "per-tensor" else reader.quantize_input(name, x),
                    *args[1:])  # fmt: skip

        module.register_forward_pre_hook(quantize_input)
    return model
