"""The benchmark corpus: real architectures built from their published configurations, random weights.

Nothing is downloaded: every ``transformers`` model is built from a config object whose values are the
published ones (written here), with seeded random weights, in eval mode. Inputs are realistic for the
model: token ids in the vocabulary range (special tokens where the tokenizer puts them, a padded row for
encoders), images with ImageNet (or ViT's 0.5/0.5) normalisation, log-mel features in Whisper's [-1, 1]
range. Each model is wrapped so that ``forward`` has explicit tensor parameters and returns the logits
first (the output the harness scores); GPT-2 with its KV cache also returns the updated ``DynamicCache``.
``bert-full`` and ``vit-full`` return every output of the base model (the first one is scored).

``transformers`` is a bench extra, not a runtime dependency: the fixture cases work without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub, even by accident

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One benchmark model.

    Attributes:
        name: Short name used on the command line and in the tables.
        build: Returns a fresh, seeded model in eval mode and its example inputs ``(args, kwargs)``.
        description: Architecture and configuration in a few words.
        logits: Whether the first output is class logits (top-1 agreement is reported).
        needs_transformers: Whether ``build`` imports ``transformers``.
        attention: The attention implementation the model runs (``sdpa``, ``eager`` or ``-``).
        jobs: The harness jobs this model runs (None: every job asked for); the full-output variants
            exist for the ONNX comparison only.
    """

    name: str
    build: Callable[[], tuple[nn.Module, Inputs]]
    description: str
    logits: bool = True
    needs_transformers: bool = True
    attention: str = "-"
    jobs: tuple[str, ...] | None = None


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def token_ids(vocab: int, batch: int, seq: int, *, bos: int | None = None, eos: int | None = None) -> torch.Tensor:
    """Token ids drawn from the ordinary range of a vocabulary (above the first 1000 special/rare ids)."""
    ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq), generator=_gen())
    if bos is not None:
        ids[:, 0] = bos
    if eos is not None:
        ids[:, -1] = eos
    return ids


def padded_mask(batch: int, seq: int) -> torch.Tensor:
    """Attention mask with every row after the first padded by a quarter of its length (right padding)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, seq - seq // 4 :] = 0
    return mask


def images(batch: int, size: int = 224, mean: float | tuple = (0.485, 0.456, 0.406),
           std: float | tuple = (0.229, 0.224, 0.225)) -> torch.Tensor:
    """Pixel values in [0, 1] with per-channel normalisation, as the image processors produce."""
    pixels = torch.rand(batch, 3, size, size, generator=_gen())
    m = torch.tensor(mean if isinstance(mean, tuple) else (mean,) * 3).view(1, 3, 1, 1)
    s = torch.tensor(std if isinstance(std, tuple) else (std,) * 3).view(1, 3, 1, 1)
    return (pixels - m) / s


class LogitsOf(nn.Module):
    """Calls a ``transformers`` model with keyword tensors and returns its ``logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class ImageLogits(LogitsOf):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(pixel_values=pixel_values).logits


class Seq2SeqLogits(LogitsOf):
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False
        ).logits


class SpeechLogits(LogitsOf):
    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False).logits


class CausalLogits(LogitsOf):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class AllOutputs(nn.Module):
    """Calls a ``transformers`` base model with keyword tensors and returns every output it computes, as a
    tuple (``to_tuple()``): for BertModel and ViTModel, ``last_hidden_state`` and ``pooler_output``.

    The pooler reads ``last_hidden_state``, so that graph output is also read inside the graph: the case
    a logits-only wrapper hides (onnxconverter-common with ``keep_io_types=True`` then writes a file ONNX
    Runtime refuses to load).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.model(input_ids=input_ids, attention_mask=attention_mask).to_tuple())


class ImageAllOutputs(AllOutputs):
    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(self.model(pixel_values=pixel_values).to_tuple())


class DecodeStep(nn.Module):
    """One decoding step of a causal LM with its default ``DynamicCache`` as input and output.

    The cache passed in is copied into a fresh ``DynamicCache`` first: the model appends to the cache it is
    given, and the benchmark runs the same inputs many times.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        from transformers.cache_utils import DynamicCache

        fresh = DynamicCache([(layer.keys, layer.values) for layer in cache.layers])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=fresh, use_cache=True)
        return out.logits, out.past_key_values


def _hf(cls_name: str, config_name: str, **config: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**config)
    return getattr(transformers, cls_name)(cfg).eval()


# ----------------------------------------------------------------------------------------- builders
def bert_base() -> tuple[nn.Module, Inputs]:
    # bert-base-uncased: BertConfig() defaults (12 layers, 768 hidden, 12 heads, 3072 FFN, 30522 vocab).
    m = _hf("BertForMaskedLM", "BertConfig", attn_implementation="sdpa")
    return LogitsOf(m).eval(), ((), {"input_ids": token_ids(30522, 2, 128, bos=101, eos=102),
                                     "attention_mask": padded_mask(2, 128)})


def distilbert() -> tuple[nn.Module, Inputs]:
    # distilbert-base-uncased: 6 layers, dim 768, 12 heads, hidden_dim 3072.
    m = _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=30522, dim=768, n_layers=6, n_heads=12,
            hidden_dim=3072, attn_implementation="sdpa")
    return LogitsOf(m).eval(), ((), {"input_ids": token_ids(30522, 2, 128, bos=101, eos=102),
                                     "attention_mask": padded_mask(2, 128)})


def _gpt2() -> nn.Module:
    # gpt2 (124M): 12 layers, n_embd 768, 12 heads, 1024 positions, 50257 vocab.
    return _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
               n_head=12, attn_implementation="sdpa")


def gpt2() -> tuple[nn.Module, Inputs]:
    return CausalLogits(_gpt2()).eval(), ((), {"input_ids": token_ids(50257, 1, 128),
                                               "attention_mask": torch.ones(1, 128, dtype=torch.long)})


def gpt2_kv(past: int = 128) -> tuple[nn.Module, Inputs]:
    """GPT-2 decoding one token after a 128-token prompt held in its default ``DynamicCache``."""
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()  # DynamicCache as a pytree node: torch.export takes it as input
    model = _gpt2()
    ids = token_ids(50257, 1, past + 1)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :past], use_cache=True).past_key_values
    mask = torch.ones(1, past + 1, dtype=torch.long)
    return DecodeStep(model).eval(), ((), {"input_ids": ids[:, past:], "attention_mask": mask, "cache": cache})


def bert_full() -> tuple[nn.Module, Inputs]:
    """BertModel (bert-base-uncased config) returning ``last_hidden_state`` and ``pooler_output``."""
    m = _hf("BertModel", "BertConfig", attn_implementation="sdpa")
    return AllOutputs(m).eval(), ((), {"input_ids": token_ids(30522, 2, 128, bos=101, eos=102),
                                       "attention_mask": padded_mask(2, 128)})


def vit_full() -> tuple[nn.Module, Inputs]:
    """ViTModel (ViT-B/16 224, with its pooler) returning ``last_hidden_state`` and ``pooler_output``."""
    m = _hf("ViTModel", "ViTConfig", image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
            num_attention_heads=12, intermediate_size=3072, attn_implementation="sdpa")
    return ImageAllOutputs(m).eval(), ((), {"pixel_values": images(1, mean=0.5, std=0.5)})


def vit_b16() -> tuple[nn.Module, Inputs]:
    # google/vit-base-patch16-224: ViTConfig() defaults, 1000 ImageNet classes.
    m = _hf("ViTForImageClassification", "ViTConfig", image_size=224, patch_size=16, hidden_size=768,
            num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, num_labels=1000,
            attn_implementation="sdpa")
    return ImageLogits(m).eval(), ((), {"pixel_values": images(1, mean=0.5, std=0.5)})


def t5_small() -> tuple[nn.Module, Inputs]:
    # t5-small: d_model 512, d_ff 2048, d_kv 64, 6+6 layers, 8 heads, 32 relative buckets, ReLU FFN.
    m = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
            num_layers=6, num_decoder_layers=6, num_heads=8, relative_attention_num_buckets=32,
            relative_attention_max_distance=128, feed_forward_proj="relu", tie_word_embeddings=True,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    dec = token_ids(32128, 2, 16)
    dec[:, 0] = 0  # decoder_start_token_id
    return Seq2SeqLogits(m).eval(), ((), {"input_ids": token_ids(32128, 2, 64, eos=1),
                                          "attention_mask": padded_mask(2, 64), "decoder_input_ids": dec})


def whisper_tiny() -> tuple[nn.Module, Inputs]:
    # openai/whisper-tiny: d_model 384, 4+4 layers, 6 heads, FFN 1536, 80 mel bins, 51865 vocab.
    m = _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=51865, num_mel_bins=80, d_model=384,
            encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
            encoder_ffn_dim=1536, decoder_ffn_dim=1536, max_source_positions=1500, max_target_positions=448,
            decoder_start_token_id=50258, attn_implementation="sdpa")
    # 30 s of log-mel features as WhisperFeatureExtractor scales them: (log10 spectrum + 4) / 4, in [-1, 1.5].
    feats = (torch.rand(1, 80, 3000, generator=_gen()) * 2.0 - 1.0).clamp(-1.0, 1.5)
    dec = token_ids(51865, 1, 16)
    dec[:, :4] = torch.tensor([50258, 50259, 50359, 50363])  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
    return SpeechLogits(m).eval(), ((), {"input_features": feats, "decoder_input_ids": dec})


def resnet50() -> tuple[nn.Module, Inputs]:
    # microsoft/resnet-50: bottleneck blocks [3, 4, 6, 3], widths 256..2048, 1000 classes.
    m = _hf("ResNetForImageClassification", "ResNetConfig", embedding_size=64, depths=[3, 4, 6, 3],
            hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck", hidden_act="relu", num_labels=1000)
    return ImageLogits(m).eval(), ((), {"pixel_values": images(1)})


def convnext_tiny() -> tuple[nn.Module, Inputs]:
    # facebook/convnext-tiny-224: depths [3, 3, 9, 3], widths [96, 192, 384, 768], 1000 classes.
    m = _hf("ConvNextForImageClassification", "ConvNextConfig", depths=[3, 3, 9, 3],
            hidden_sizes=[96, 192, 384, 768], image_size=224, patch_size=4, num_labels=1000)
    return ImageLogits(m).eval(), ((), {"pixel_values": images(1)})


def _fixture(name: str) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        from fixtures.zoo import make

        return make(name)

    return build


FIXTURE_CASES = {
    "fx-mlp": ("mlp", "fixture: 2-layer MLP with GELU", True),
    "fx-cnn": ("cnn", "fixture: CNN with BatchNorm, 32x32", True),
    "fx-transformer": ("transformer", "fixture: 2-layer encoder, matmul attention", False),
    "fx-causal": ("causal", "fixture: causal block with SDPA", False),
}

#: The jobs of the full-output variants: both tools' ONNX files (onnxconverter-common's and amplite fp16:O2).
ONNX_ONLY = ("onnx", "amplite:fp16:O2")

CASES: dict[str, Case] = {
    **{k: Case(k, _fixture(v[0]), v[1], logits=v[2], needs_transformers=False) for k, v in FIXTURE_CASES.items()},
    # real models, cheapest first: a run stopped part-way has measured the most models
    "distilbert": Case("distilbert", distilbert, "DistilBERT-base MLM, 2x128 tokens (1 padded)", attention="sdpa"),
    "resnet50": Case("resnet50", resnet50, "ResNet-50, 1x3x224x224"),
    "convnext-tiny": Case("convnext-tiny", convnext_tiny, "ConvNeXt-tiny, 1x3x224x224"),
    "gpt2-kv": Case("gpt2-kv", gpt2_kv, "GPT-2 124M, 1 token after 128 cached (DynamicCache)", attention="sdpa"),
    "t5-small": Case("t5-small", t5_small, "T5-small seq2seq, 2x64 in, 2x16 decoder", attention="sdpa"),
    "whisper-tiny": Case("whisper-tiny", whisper_tiny, "Whisper-tiny, 30 s log-mel, 16 decoder tokens",
                         attention="sdpa"),
    "vit-b16": Case("vit-b16", vit_b16, "ViT-B/16, 1x3x224x224, 1000 classes", attention="sdpa"),
    "bert-base": Case("bert-base", bert_base, "BERT-base MLM, 2x128 tokens (1 padded)", attention="sdpa"),
    "gpt2": Case("gpt2", gpt2, "GPT-2 124M LM, 1x128 tokens, no cache", attention="sdpa"),
    # every output, not only the logits: outputs that are also read inside the graph (ONNX comparison)
    "bert-full": Case("bert-full", bert_full, "BertModel (BERT-base), 2x128 tokens, all outputs "
                      "(last_hidden_state, pooler_output)", logits=False, attention="sdpa", jobs=ONNX_ONLY),
    "vit-full": Case("vit-full", vit_full, "ViTModel (ViT-B/16), 1x3x224x224, all outputs "
                     "(last_hidden_state, pooler_output)", logits=False, attention="sdpa", jobs=ONNX_ONLY),
}

#: Fits 10 minutes on 2 CPU cores: the fixtures plus one real transformer encoder.
QUICK = ["fx-cnn", "fx-transformer", "fx-causal", "distilbert"]


def have_transformers() -> bool:
    """Whether the optional ``transformers`` package is importable."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def attention_of(model: nn.Module) -> str:
    """The attention implementation a ``transformers`` model actually runs (``-`` for other models)."""
    inner = getattr(model, "model", model)
    cfg = getattr(inner, "config", None)
    return getattr(cfg, "_attn_implementation", None) or "-"
