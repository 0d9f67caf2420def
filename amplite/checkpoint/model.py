"""The model a checkpoint's ``config.json`` describes, built on the meta device without running its code.

What a config may select is bounded by construction:

* no remote code: a config with ``auto_map`` (custom Python shipped with the checkpoint) is refused before
  transformers is asked anything, so its "[y/N] run custom code?" prompt is never reached;
* only transformers' own classes: ``model_type`` must be one of transformers' config types and
  ``architectures[0]`` a ``PreTrainedModel`` subclass that transformers' own auto mappings register for
  that type (never an arbitrary attribute of the ``transformers`` module);
* bounded work: counts that cost time while building (layers, experts) may not exceed what the shards
  hold, every parameter is created on meta (no allocation whatever the sizes), and the buffers the
  model computes itself are materialised only when they are small.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from amplite.checkpoint.source import Checkpoint, LogitsOnly
from amplite.errors import LoadError

#: Config counts above this that exceed the numbered modules in the shards are refused before building.
MAX_FREE_COUNT = 512
#: Bytes of model-computed buffers (rotary tables, position ids) allowed beyond the checkpoint's own size.
MAX_BUFFER_BYTES = 64 * 2**20
_COUNT_KEY = re.compile(r"(layers|layer|experts|blocks)$", re.IGNORECASE)  # num_hidden_layers, n_layer, num_experts
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise LoadError("converting a checkpoint directory needs transformers", "pip install transformers") from None
    return transformers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while it reads a config and builds a model (a refusal is one line)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _fail(ckpt: Checkpoint, what: str, fix: str) -> LoadError:
    return LoadError(f"{ckpt.path / 'config.json'}: {what}", fix)


def check_config(ckpt: Checkpoint) -> None:
    """Refuse configs that need remote code or drive unbounded work (before transformers sees them).

    Raises:
        LoadError: ``auto_map``, no ``model_type``, or a layer/expert count the shards do not hold.
    """
    cfg = ckpt.config
    if "auto_map" in cfg or any(isinstance(v, dict) and "auto_map" in v for v in cfg.values()):
        raise _fail(ckpt, "auto_map names custom model code shipped with the checkpoint; amplite never runs it",
                    "convert a model transformers implements (drop auto_map only if it is one)")  # fmt: skip
    quantized = [k for k, v in (("", cfg), *cfg.items()) if isinstance(v, dict) and v.get("quantization_config")]
    if quantized:  # its weights are packed for a quantizer: casting them would write another model
        where = f"{quantized[0]}." if quantized[0] else ""
        raise _fail(ckpt, f"{where}quantization_config: a pre-quantized checkpoint (transformers' quantizer loads "
                    "it); amplite converts floating-point checkpoints only",
                    "convert the unquantized (FP32/bf16/fp16) checkpoint instead")  # fmt: skip
    if not isinstance(cfg.get("model_type"), str):
        raise _fail(ckpt, "no model_type", "save the config with transformers (save_pretrained)")
    held = 1 + max((int(i) for n in ckpt.tensors for i in _INDEX.findall(n)), default=0)
    for section in (cfg, *(v for v in cfg.values() if isinstance(v, dict))):
        for key, value in section.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _COUNT_KEY.search(key):
                continue
            if value > MAX_FREE_COUNT and value > held:
                raise _fail(ckpt, f"{key} is {value:g} but the shards number their modules only up to {held - 1}",
                            "fix the count in config.json (it must match the saved weights)")  # fmt: skip


def resolve_class(ckpt: Checkpoint, config: Any) -> type:
    """The ``PreTrainedModel`` class for ``architectures[0]``, from transformers' own auto mappings only.

    Without ``architectures``: the causal-LM class of the model type, else its base model.

    Raises:
        LoadError: An architecture transformers does not register for this ``model_type``.
    """
    transformers = _transformers()
    from transformers.models.auto import modeling_auto

    model_type = config.model_type
    registered: list[str] = []
    for attr in sorted(dir(modeling_auto)):
        table = getattr(modeling_auto, attr)
        if attr.endswith("_MAPPING_NAMES") and attr != "CONFIG_MAPPING_NAMES" and isinstance(table, dict):
            names = table.get(model_type)
            registered.extend([names] if isinstance(names, str) else list(names or ()))
    archs = ckpt.config.get("architectures") or []
    if archs and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise _fail(ckpt, "architectures is not a list of class names", "regenerate config.json")
    if archs:
        arch = archs[0]
        if arch not in registered:
            raise _fail(ckpt, f"architectures[0] {arch!r} is not a transformers model class for model_type "
                        f"{model_type!r}", f"use one of: {', '.join(sorted(set(registered))) or '(none)'}")  # fmt: skip
    else:
        causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        arch = causal or modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        if not isinstance(arch, str):
            raise _fail(ckpt, f"no architectures and no default class for {model_type!r}",
                        "add architectures to config.json")  # fmt: skip
    cls = getattr(transformers, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise _fail(ckpt, f"{arch!r} is not a PreTrainedModel class", "add a model class to architectures")
    return cls


def build_config(ckpt: Checkpoint) -> Any:
    """transformers' config object for ``config.json``, read by transformers' own loader (its config classes only:
    ``auto_map`` and unknown types are refused first)."""
    transformers = _transformers()
    check_config(ckpt)
    if ckpt.config["model_type"] not in transformers.CONFIG_MAPPING:
        raise _fail(ckpt, f"unknown model_type {ckpt.config['model_type']!r}", "check model_type in config.json")
    try:  # transformers' own reader (it decodes the {"__float__": "Infinity"} its writer stores, for one)
        return transformers.AutoConfig.from_pretrained(str(ckpt.path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise _fail(ckpt, f"transformers cannot read it: {type(exc).__name__}: {exc}",
                    "check model_type and the sizes in config.json") from None  # fmt: skip


def build_meta_model(ckpt: Checkpoint) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model from ``config.json`` with every parameter on meta, and the buffers it computes itself.

    Returns:
        The model wrapped in :class:`LogitsOnly` (everything on meta, eval mode) and the real values of
        its buffers by (wrapped) name, initialised as ``from_pretrained`` initialises them.

    Raises:
        LoadError: Remote code, an unknown architecture, a config transformers rejects, oversized buffers.
    """
    with quiet_transformers():
        return _build(ckpt)


def _build(ckpt: Checkpoint) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = build_config(ckpt)
    cls = resolve_class(ckpt, config)
    if hasattr(config, "_experts_implementation"):  # MoE: the batched kernel has no device-dependent branch
        config._experts_implementation = "batched_mm"  # (the default one takes a CUDA path on meta tensors)
    try:
        with torch.device("meta"):
            lm = cls(config)
    except Exception as exc:
        raise _fail(ckpt, f"transformers cannot build {cls.__name__}: {type(exc).__name__}: {exc}",
                    "check the sizes in config.json") from None  # fmt: skip
    budget = MAX_BUFFER_BYTES + ckpt.total_bytes
    buffers = list(lm.named_buffers())
    size = sum(b.numel() * b.element_size() for _, b in buffers)
    if size > budget:
        name, big = max(buffers, key=lambda kv: kv[1].numel() * kv[1].element_size())
        raise _fail(ckpt, f"the model computes {size / 2**20:.0f} MiB of buffers (e.g. {name}, "
                    f"{tuple(big.shape)}) for {ckpt.total_bytes / 2**20:.1f} MiB of weights",
                    "fix the sizes in config.json (max_position_embeddings?)")  # fmt: skip
    for name, b in buffers:  # real storage for buffers, then transformers' own init computes them
        owner, _, attr = name.rpartition(".")
        lm.get_submodule(owner)._buffers[attr] = torch.empty_like(b, device="cpu")
    for p in lm.parameters():
        p._is_hf_initialized = True
    try:
        lm.initialize_weights()
    except Exception as exc:
        raise _fail(ckpt, f"transformers cannot initialise {cls.__name__}'s buffers: {type(exc).__name__}: {exc}",
                    "check the config") from None  # fmt: skip
    model = LogitsOnly(lm).eval()
    real = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    for module in model.modules():
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type != "meta":
                module._buffers[bname] = b.to("meta")
    return model, real
