"""The step module: one ``torch.export``-able forward that serves prefill and decode with a KV cache.

``LMStep(model)(input_ids, attention_mask, past_keys, past_values) -> (logits, keys, values)``:

* ``input_ids`` ``[B, S]`` int64: the new tokens (the prompt at prefill, one token per decode step).
* ``attention_mask`` ``[B, P + S]``: 1 for real tokens, 0 for (left) padding, over the cache and the new tokens.
* ``past_keys``/``past_values`` ``[L, B, H_kv, P, D]`` in the cache dtype: the cache; ``P = 0`` at prefill.
* ``logits`` ``[B, S, V]`` FP32; ``keys``/``values`` ``[L, B, H_kv, S, D]``: the new tokens' keys and values
  only (the cache after the step is the past followed by them; :class:`~amplite.llm.generate.Runner` writes
  them into its preallocated cache, so the step never copies the whole cache to return it).

B, S and P are dynamic. Positions come from the mask (``cumsum - 1``), so left-padded prompts of different
lengths share a batch as in ``transformers``' ``generate``. The cache is a plain tensor pair in, the new
tokens' pair out, so the program is functional (no buffers or inputs mutated: an exported in-place write
would be functionalized into a copy of the whole cache) and one program serves every batch, prompt and
cache length. Attention runs through ``scaled_dot_product_attention`` with a boolean mask (the ``amplite_sdpa``
implementation registered below): ``transformers``' own SDPA path branches on the query length, which would
fix ``S`` at export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amplite.errors import ConfigError

ATTN_IMPL = "amplite_sdpa"


@dataclass(frozen=True)
class CacheShape:
    """Geometry of the KV cache: ``[layers, batch, kv_heads, length, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int

    def empty(self, batch: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A cache holding no tokens (prefill's input), on ``device`` (the program's: :func:`program_device`)."""
        return torch.zeros(self.layers, batch, self.kv_heads, 0, self.head_dim, dtype=dtype, device=device)


def program_device(step: object) -> torch.device:
    """The device a step program computes on: that of its first parameter or buffer.

    Every tensor the decode path makes is made there, so a CUDA program is never fed a tensor that a factory
    call without ``device`` put on the CPU. A callable holding no tensor (a plain function) gets torch's
    default device, the one such factory calls would use anyway.
    """
    if isinstance(step, nn.Module):
        for t in (*step.parameters(), *step.buffers()):
            return t.device
    return torch.get_default_device()


def cache_shape(model: nn.Module) -> CacheShape:
    """The KV-cache geometry of a ``transformers`` causal LM, from its config.

    Raises:
        ConfigError: The model is not a ``transformers`` causal LM with a decoder config.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ConfigError(
            f"{type(model).__name__} is not a transformers causal LM (no config)",
            "pass a transformers *ForCausalLM model (e.g. LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel)",
        )
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        raise ConfigError(
            f"cannot read the KV-cache shape from the config of {type(model).__name__}",
            "use a decoder-only transformers model with num_hidden_layers, num_attention_heads and hidden_size",
        )
    return CacheShape(int(layers), int(kv_heads), int(head_dim))


def _sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with the step's boolean mask (:func:`step_mask`) and no branch on the query length
    (``[B, S, H, D]`` out, as transformers')."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if attention_mask is None:  # plain causal
        attention_mask = torch.ones(query.shape[0], key.shape[-2], dtype=torch.long, device=query.device)
    mask = step_mask(attention_mask, query.shape[-2]) if attention_mask.dim() == 2 else attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    return out.transpose(1, 2).contiguous(), None


def step_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """The ``[B, 1, S, P + S]`` boolean attention mask of a step from its 2-D ``[B, P + S]`` padding mask.

    Causal, padding masked, and each query also sees its own position: a padding token's row would
    otherwise mask everything (NaN in SDPA, and NaN times a zero weight is still NaN once cached). Real
    tokens see themselves anyway, so their outputs do not change; padding rows get finite values nobody
    attends to. Built with ``logical_*``/``arange`` only, which keeps slicing by a symbolic size (and the
    ``max()``/``min()`` guards it adds) out of the exported step.
    """
    kv_len = attention_mask.shape[-1]
    keys = torch.arange(kv_len, device=attention_mask.device)
    own = (torch.arange(q_len, device=attention_mask.device) + (kv_len - q_len))[:, None]  # [S, 1]
    allowed = torch.logical_and(keys[None, :] <= own, attention_mask.bool()[:, None, None, :])
    return torch.logical_or(allowed, keys[None, :] == own)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _sdpa_attention)
    # LMStep passes its own 4-D mask (transformers uses it as is); a mask function must exist all the same
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)


@contextlib.contextmanager
def amplite_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with the ``amplite_sdpa`` attention; its configs are restored afterwards."""
    _register()
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    configs = list({id(c): c for c in configs}.values())
    saved = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTN_IMPL
        yield
    finally:
        for c, impl in zip(configs, saved, strict=True):
            c._attn_implementation = impl


class LMStep(nn.Module):
    """Prefill and decode as one functional forward (module docstring).

    Args:
        model: A ``transformers`` causal LM in eval mode (shared, not copied).
        cache_dtype: Dtype of the cache tensors in and out; the model computes in its own dtype in between.
    """

    def __init__(self, model: nn.Module, cache_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model = model
        self.cache_dtype = cache_dtype
        self.shape = cache_shape(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step; see the module docstring for shapes."""
        dtype = next(self.model.parameters()).dtype
        cache = _seeded_cache(self.model.config, past_keys.to(dtype), past_values.to(dtype))
        # Gathered, not sliced: a slice by a symbolic offset adds max()/min() relations to the program's guards.
        new = torch.arange(input_ids.shape[1], device=input_ids.device) + (attention_mask.shape[1] - input_ids.shape[1])
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).gather(1, new.expand_as(input_ids))
        out = self.model(
            input_ids=input_ids,
            attention_mask=step_mask(attention_mask, input_ids.shape[1]),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        # Only this step's keys/values leave the program: returning the whole cache would copy it once more
        # per step (a stack of every layer's); the runner writes them into its preallocated cache instead.
        keys = torch.stack([layer.new_states[0] for layer in cache.layers]).to(self.cache_dtype)
        values = torch.stack([layer.new_states[1] for layer in cache.layers]).to(self.cache_dtype)
        return out.logits.float(), keys, values


def _seeded_cache(config: Any, past_keys: torch.Tensor, past_values: torch.Tensor) -> Any:
    """A ``DynamicCache`` holding ``past_keys[i]``/``past_values[i]`` as they are (views, no copy).

    ``DynamicCache(ddp_cache_data=...)`` seeds each layer with ``update``, i.e. ``cat`` onto an empty tensor:
    a copy of the whole past cache on every step, on top of the copy each layer's own ``update`` makes when
    the new tokens arrive. Full-attention layers take the past directly instead; other layer kinds (sliding
    windows, which may trim) keep ``update``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if len(cache.layers) != past_keys.shape[0]:  # a config whose layers the cache does not list one by one
        cache = DynamicCache(ddp_cache_data=list(zip(past_keys, past_values, strict=True)), config=config)
        for layer in cache.layers:
            _record_new_states(layer)
        return cache
    for layer, keys, values in zip(cache.layers, past_keys, past_values, strict=True):
        if type(layer) is DynamicLayer:
            layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
        else:
            layer.update(keys, values)
        _record_new_states(layer)
    return cache


def _record_new_states(layer: Any) -> None:
    """Make ``layer.update`` keep the keys/values it is given (this step's tokens) as ``layer.new_states``."""
    update = layer.update

    def recording(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layer.new_states = (key_states, value_states)
        return update(key_states, value_states, *args, **kwargs)

    layer.update = recording
