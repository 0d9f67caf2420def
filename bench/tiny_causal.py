"""Tiny configs for every family of transformers' causal-LM registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).

Each family's own config class is built with its defaults, then every size attribute it has is shrunk to
the values below (in the config and in its text sub-config); a family "builds from a tiny config" when
that config constructs, the model has at most :data:`MAX_PARAMS` parameters and one FP32 forward on 8
tokens gives finite logits. Whatever fails is reported with its reason, not silently dropped.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
MAX_PARAMS = 16_000_000
#: size attribute -> tiny value; only attributes the family's default config has are set.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "n_inner": 64, "n_ctx": 64, "d_model": 32,
    "ffn_dim": 64, "num_layers": 2, "num_heads": 4, "d_ff": 64, "d_kv": 8, "embed_dim": 32,
    "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "word_embed_proj_dim": 32,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "state_size": 8, "n_groups": 1, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 8,
    "mamba_d_head": 8, "mamba_head_dim": 8, "mamba_n_groups": 1, "time_step_rank": 4, "attention_hidden_size": 32,
    "lru_width": 32, "block_size": 64, "rotary_dim": 8, "ffn_hidden_size": 64,
    "num_hidden_groups": 1, "inner_group_num": 1, "embedding_size": 32, "projection_dim": 32,
    "moe_intermediate_size_shared": 32, "max_window_layers": 2, "num_encoder_layers": 2,
    "num_decoder_layers": 2,
}  # fmt: skip
#: Family-specific values the generic shrink gets wrong (checked: each builds and runs with these).
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8, "head_dim": 8, "expand": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "reformer": {"is_decoder": True},
    "phi": {"partial_rotary_factor": 0.5},
    "gpt_neox": {"rotary_pct": 0.5},
    "mixtral": {"num_experts_per_tok": 2},
}


def registry() -> dict[str, str]:
    """model_type -> causal-LM class name, as transformers registers them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has(cfg: Any, key: str) -> bool:
    if isinstance(getattr(type(cfg), key, None), property):
        return False  # derived from other sizes
    try:
        return hasattr(cfg, key)
    except Exception:  # a per-layer attribute some configs refuse to read globally
        return False


#: Token ids beyond the tiny vocabulary are moved into it.
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0, "sep_token_id": 2,
             "cls_token_id": 1, "mask_token_id": 3, "unk_token_id": 3}  # fmt: skip


def _shrink(cfg: Any, extra: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in SIZES.items() if _has(cfg, k)}
    for key, tiny in TOKEN_IDS.items():
        value = getattr(cfg, key, None) if _has(cfg, key) else None
        if (isinstance(value, int) and value >= VOCAB) or isinstance(value, list):
            kwargs[key] = tiny
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:  # MLA: no grouped keys
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(extra)
    if "layer_types" in getattr(cfg, "__dict__", {}) and "layer_types" not in extra:  # sized by the layer count
        layers = kwargs.get("num_hidden_layers", 2)
        kinds = list(dict.fromkeys(cfg.layer_types or ["full_attention"]))
        kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return kwargs


def tiny_config(model_type: str) -> Any:
    """The family's config class with its size attributes shrunk (text sub-config too)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = _shrink(default, OVERRIDES.get(model_type, {}))
    text = getattr(default, "text_config", None)
    if text is not None and hasattr(text, "to_dict"):
        kwargs["text_config"] = {**text.to_dict(), **_shrink(text, {})}
    for _ in range(6):  # a size this family derives or refuses to take is left at its default
        try:
            return cls(**kwargs)
        except Exception as exc:
            named = [k for k in kwargs if k in str(exc) and k not in OVERRIDES.get(model_type, {})]
            if not named:
                raise
            del kwargs[max(named, key=len)]
    return cls(**kwargs)


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The tiny FP32 model of ``model_type`` (seeded), checked to run.

    Raises:
        ValueError: The family does not build from a tiny config (the message says why).
    """
    import transformers

    cls_name = registry()[model_type]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ValueError(f"{cls_name} is not exported by transformers")
    try:
        cfg = tiny_config(model_type)
    except Exception as exc:
        raise ValueError(f"config: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}") from None
    try:
        with torch.device("meta"):  # sized first: a family whose shrink misses a size is not built for real
            count = sum(p.numel() for p in cls(cfg).parameters())
        if count > MAX_PARAMS:
            raise ValueError(f"not tiny: {count / 1e6:.1f}M parameters after shrinking")
        torch.manual_seed(seed)
        model = cls(cfg).eval()
    except ValueError as exc:
        if str(exc).startswith("not tiny"):
            raise
        raise ValueError(f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}") from None
    except Exception as exc:
        raise ValueError(f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}") from None
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, return_dict=False)[0]
    except Exception as exc:
        raise ValueError(f"forward: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}") from None
    if not torch.isfinite(logits.float()).all():
        raise ValueError("forward: non-finite FP32 logits")
    return model
