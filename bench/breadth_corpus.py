"""The breadth corpus: many ``transformers`` architectures from tiny configs, random seeded weights.

Each entry is an architecture at toy size (2 layers, hidden 32, vocab 128, images 32x32…): the point is
coverage of the ops, masks and constants each family's code produces, not numerics at scale. Nothing is
downloaded. Inputs follow ``bench.corpus``: token ids in range with a right-padded row where the model
takes an attention mask, normalised images, log-mel features, raw audio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.corpus import (
    CausalLogits,
    ImageLogits,
    Inputs,
    LogitsOf,
    Seq2SeqLogits,
    SpeechLogits,
    _gen,
    _hf,
    images,
    padded_mask,
    token_ids,
)

VOCAB, SEQ = 128, 12
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@dataclass(frozen=True)
class Arch:
    """One architecture of the sweep: ``build()`` returns a fresh eval-mode model and its inputs."""

    name: str
    family: str
    build: Callable[[], tuple[nn.Module, Inputs]]


class AudioLogits(LogitsOf):
    def forward(self, input_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(input_values=input_values).logits


class DecoderOnlyLogits(LogitsOf):
    """Causal LMs whose forward takes no attention mask worth padding (Mamba)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(input_ids=input_ids, use_cache=False).logits


def _text(batch: int = 2) -> dict[str, torch.Tensor]:
    return {"input_ids": token_ids(VOCAB, batch, SEQ), "attention_mask": padded_mask(batch, SEQ)}


def causal(cls: str, cfg: str, **config: Any) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        m = _hf(cls, cfg, vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=2, **config)
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :3] = 0  # left padding, as generation batches use
        return CausalLogits(m).eval(), ((), {"input_ids": token_ids(VOCAB, 2, SEQ), "attention_mask": mask})

    return build


def encoder(cls: str, cfg: str, **config: Any) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        return LogitsOf(_hf(cls, cfg, vocab_size=VOCAB, **config)).eval(), ((), _text())

    return build


def seq2seq(cls: str, cfg: str, **config: Any) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        m = _hf(cls, cfg, vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=1, eos_token_id=2, **config)
        dec = token_ids(VOCAB, 2, 6)
        dec[:, 0] = 0
        return Seq2SeqLogits(m).eval(), ((), {**_text(), "decoder_input_ids": dec})

    return build


def vision(cls: str, cfg: str, size: int = 32, **config: Any) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        m = _hf(cls, cfg, num_labels=10, **config)
        return ImageLogits(m).eval(), ((), {"pixel_values": images(2, size)})

    return build


def audio(cls: str, cfg: str) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        m = _hf(cls, cfg, vocab_size=32, **TINY, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                feat_extract_norm="layer")
        wave = torch.randn(2, 800, generator=_gen()) * 0.1
        return AudioLogits(m).eval(), ((), {"input_values": wave})

    return build


def whisper() -> tuple[nn.Module, Inputs]:
    m = _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=VOCAB, num_mel_bins=16, d_model=32,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
            decoder_start_token_id=0, pad_token_id=1, eos_token_id=2, bos_token_id=0, suppress_tokens=[],
            begin_suppress_tokens=[])
    feats = (torch.rand(2, 16, 32, generator=_gen()) * 2.0 - 1.0).clamp(-1.0, 1.5)
    dec = token_ids(VOCAB, 2, 6)
    dec[:, 0] = 0
    return SpeechLogits(m).eval(), ((), {"input_features": feats, "decoder_input_ids": dec})


def mamba() -> tuple[nn.Module, Inputs]:
    m = _hf("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
            expand=2, conv_kernel=4, use_cache=False)
    return DecoderOnlyLogits(m).eval(), ((), {"input_ids": token_ids(VOCAB, 2, SEQ)})


_DEC = dict(TINY, num_key_value_heads=2, max_position_embeddings=64)
_GPT = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)
_BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
_VIT = dict(TINY, image_size=32, patch_size=8)
_DEBERTA_V3 = dict(TINY, max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"],
                   norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False, position_buckets=16,
                   max_relative_positions=-1)

ARCHS: list[Arch] = [
    # decoder LMs
    Arch("llama", "decoder", causal("LlamaForCausalLM", "LlamaConfig", **_DEC)),
    Arch("mistral", "decoder", causal("MistralForCausalLM", "MistralConfig", **_DEC)),
    Arch("qwen2", "decoder", causal("Qwen2ForCausalLM", "Qwen2Config", **_DEC)),
    Arch("gemma", "decoder", causal("GemmaForCausalLM", "GemmaConfig", head_dim=8, **_DEC)),
    Arch("gemma2", "decoder", causal("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, sliding_window=8, **_DEC)),
    Arch("phi", "decoder", causal("PhiForCausalLM", "PhiConfig", **_DEC)),
    Arch("phi3", "decoder", causal("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, **_DEC)),
    Arch("falcon", "decoder", causal("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4)),
    Arch("bloom", "decoder", causal("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=4)),
    Arch("opt", "decoder", causal("OPTForCausalLM", "OPTConfig", hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                  num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64)),
    Arch("gptj", "decoder", causal("GPTJForCausalLM", "GPTJConfig", rotary_dim=4, **_GPT)),
    Arch("gpt2", "decoder", causal("GPT2LMHeadModel", "GPT2Config", **_GPT)),
    Arch("gpt-neox", "decoder", causal("GPTNeoXForCausalLM", "GPTNeoXConfig", **TINY, max_position_embeddings=64)),
    # encoders
    Arch("bert", "encoder", encoder("BertForMaskedLM", "BertConfig", **TINY)),
    Arch("roberta", "encoder", encoder("RobertaForMaskedLM", "RobertaConfig", **TINY, pad_token_id=1)),
    Arch("distilbert", "encoder", encoder("DistilBertForMaskedLM", "DistilBertConfig", dim=32, n_layers=2, n_heads=4,
                                          hidden_dim=64)),
    Arch("deberta", "encoder", encoder("DebertaForMaskedLM", "DebertaConfig", **TINY, max_position_embeddings=64,
                                       relative_attention=True, pos_att_type=["p2c", "c2p"])),
    Arch("deberta-v2", "encoder", encoder("DebertaV2ForMaskedLM", "DebertaV2Config", **_DEBERTA_V3)),
    Arch("electra", "encoder", encoder("ElectraForMaskedLM", "ElectraConfig", **TINY, embedding_size=16)),
    Arch("albert", "encoder", encoder("AlbertForMaskedLM", "AlbertConfig", **TINY, embedding_size=16)),
    Arch("mpnet", "encoder", encoder("MPNetForMaskedLM", "MPNetConfig", **TINY)),
    # seq2seq
    Arch("bart", "seq2seq", seq2seq("BartForConditionalGeneration", "BartConfig", **_BART)),
    Arch("pegasus", "seq2seq", seq2seq("PegasusForConditionalGeneration", "PegasusConfig", **_BART)),
    Arch("t5", "seq2seq", seq2seq("T5ForConditionalGeneration", "T5Config", d_model=32, d_kv=8, d_ff=64,
                                  num_layers=2, num_heads=4)),
    # vision
    Arch("vit", "vision", vision("ViTForImageClassification", "ViTConfig", **_VIT)),
    Arch("deit", "vision", vision("DeiTForImageClassification", "DeiTConfig", **_VIT)),
    Arch("beit", "vision", vision("BeitForImageClassification", "BeitConfig", **_VIT,
                                  use_relative_position_bias=True)),
    Arch("swin", "vision", vision("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4,
                                  embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
    Arch("convnext", "vision", vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16],
                                      depths=[1, 1], num_stages=2)),
    Arch("regnet", "vision", vision("RegNetForImageClassification", "RegNetConfig", embedding_size=8,
                                    hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)),
    Arch("resnet", "vision", vision("ResNetForImageClassification", "ResNetConfig", embedding_size=8,
                                    hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    Arch("mobilenet-v2", "vision", vision("MobileNetV2ForImageClassification", "MobileNetV2Config", size=64,
                                          image_size=64, depth_multiplier=0.35)),
    Arch("segformer", "vision", vision("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2,
                                       depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3],
                                       strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                       decoder_hidden_size=16)),
    Arch("yolos", "vision", vision("YolosForObjectDetection", "YolosConfig", **dict(_VIT, image_size=[32, 32]),
                                   num_detection_tokens=4)),
    # audio
    Arch("whisper", "audio", whisper),
    Arch("hubert", "audio", audio("HubertForCTC", "HubertConfig")),
    Arch("wav2vec2", "audio", audio("Wav2Vec2ForCTC", "Wav2Vec2Config")),
    # state space
    Arch("mamba", "state-space", mamba),
]

BY_NAME = {a.name: a for a in ARCHS}
