"""The generation check of a converted checkpoint directory (``amplite convert DIR --tolerance
token_agreement>=0.99``): token agreement, first divergence and perplexity delta of the **written** safetensors
directory, run as ``from_pretrained`` loads it, against the source directory loaded in FP32.

The two models are never in memory together: the FP32 reference runs first (its greedy continuations and
perplexity are kept, a few kB), is dropped, and only then is the converted directory loaded and fed the
reference's tokens (teacher forcing, :mod:`amplite.llm.metrics`). The peak is therefore one FP32 copy of the
model plus activations, not the streamed conversion's bound: the check runs only when a tolerance names
``token_agreement`` or ``ppl_delta``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from amplite.checkpoint.convert import peak_rss_bytes
from amplite.checkpoint.fp8_model import Activations, is_fp8_dir, load_fp8_model
from amplite.checkpoint.result import register_generation_check
from amplite.errors import ConfigError
from amplite.llm.generate import Runner, prepare
from amplite.llm.metrics import (
    LLM_METRICS,
    LLMMetrics,
    default_eval_ids,
    default_prompts,
    failures,
    judge,
    reference_run,
)
from amplite.llm.step import LMStep, amplite_attention
from amplite.report.document import Report
from amplite.report.sections import Llm, Verification
from amplite.verify.criteria import Criterion, Tolerance, parse_criterion, parse_tolerance

#: What the report says was run as the converted model.
CONVERTED = "the written safetensors directory, loaded by from_pretrained in the dtype its config.json names"
#: ... and for an FP8 directory (amplite.checkpoint.fp8_model).
CONVERTED_FP8 = ("the written FP8 directory: weights dequantized with their weight_scale into a bf16 model, each FP8 "
                 "linear's input quantized to e4m3 as the server does (static input_scale, or per token)")


@dataclass
class GenerationCheck:
    """The LLM criteria of a tolerance and how to measure them; call it on the written directory.

    Attributes:
        source: The checkpoint directory (the FP32 reference is loaded from it).
        criteria: The ``token_agreement``/``ppl_delta`` criteria to judge.
        steps: Greedy steps per prompt.
        prompts, attention_mask, eval_ids: As for :func:`amplite.llm.verify_llm` (default: seeded random).
    """

    source: Path
    criteria: list[Criterion]
    steps: int = 32
    prompts: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    eval_ids: torch.Tensor | None = None
    metrics: LLMMetrics | None = field(default=None, repr=False)

    def __call__(self, report: Report, converted: Path) -> tuple[Report, list[str]]:
        """Measure ``converted`` against the source: a new report (``report`` with the ``llm`` section and the
        verdict folded into ``verification.passed``; ``report`` is frozen, the caller rebinds) and the failed
        criteria, one line each (:meth:`reasons`)."""
        metrics = verify_checkpoint(self.source, converted, criteria=self.criteria, steps=self.steps,
                                    prompts=self.prompts, attention_mask=self.attention_mask,
                                    eval_ids=self.eval_ids)  # fmt: skip
        self.metrics = metrics
        dtype = json.loads((converted / "config.json").read_text(encoding="utf-8")).get("dtype", "float32")
        what = CONVERTED_FP8 if is_fp8_dir(converted) else CONVERTED
        dtype = "float8_e4m3fn" if is_fp8_dir(converted) else dtype
        llm = Llm.of({"converted": what, "converted_dtype": str(dtype), **metrics.to_dict(),
                      "peak_rss_bytes": peak_rss_bytes()})  # fmt: skip
        verification = report.section(Verification)
        folded = (verification.folded(metrics.passed),) if verification is not None else ()
        return report.with_sections(llm, *folded), self.reasons()

    def reasons(self) -> list[str]:
        """The failed criteria, one line each (empty before the call or when every criterion held)."""
        return failures(self.metrics) if self.metrics is not None else []


def llm_criteria_of(tolerance: Sequence[str] | Tolerance | None, precision: str = "fp16") -> list[Criterion]:
    """The ``token_agreement``/``ppl_delta`` criteria a tolerance names (empty: no generation check).

    Raises:
        ConfigError: A malformed criterion.
    """
    if tolerance is None:
        return []
    tol = tolerance if isinstance(tolerance, Tolerance) else parse_tolerance(list(tolerance), precision)
    return [c for c in (parse_criterion(t) for t in tol.criteria) if c.metric in LLM_METRICS]


def generation_check(
    source: str | Path, tolerance: Sequence[str] | Tolerance | None, precision: str = "fp16", **kwargs: Any
) -> GenerationCheck | None:
    """The generation check a tolerance asks for on checkpoint ``source`` (None when it names no LLM metric),
    checked before anything is converted: the checkpoint must be a transformers causal LM.

    Raises:
        ConfigError: A malformed criterion, a scoped LLM criterion, or a checkpoint that is not a causal LM.
    """
    criteria = llm_criteria_of(tolerance, precision)
    if not criteria:
        return None
    scoped = [c for c in criteria if c.output is not None]
    if scoped:
        raise ConfigError(f"{scoped[0]} is scoped to an output, but {scoped[0].metric} is measured on generation",
                          f"write it unscoped: {scoped[0].metric}{scoped[0].op}{scoped[0].threshold:g}")  # fmt: skip
    _check_causal(Path(source), criteria[0])
    return GenerationCheck(Path(source), criteria, **kwargs)


register_generation_check(generation_check)  # amplite.convert(DIR, tolerance=[...]).save(OUT) gates as the CLI


def _check_causal(source: Path, criterion: Criterion) -> None:
    """The checkpoint's class must be a transformers causal LM (what ``AutoModelForCausalLM`` loads it as)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the checkpoint reader names what is wrong with the directory
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if (archs and archs[0] not in set(CAUSAL.values())) or (not archs and model_type not in CAUSAL):
        what = archs[0] if archs else repr(model_type)
        raise ConfigError(f"{criterion} needs a causal LM, but {source} holds a {what} (no LM head to generate with)",
                          "drop the token_agreement/ppl_delta criteria (sqnr etc. still apply)")  # fmt: skip
    _check_window(source, config, criterion)


def sliding_window(config: dict[str, Any]) -> int | None:
    """The smallest attention window a config (or its text config) sets, None when attention is full.

    The check's steps keep the cache as one growing tensor (as the ``.pt2`` step program does), while
    transformers keeps only the last ``window - 1`` tokens of a sliding layer: the check is sized to stay inside
    the window (prompt + steps, and the perplexity tokens, at most ``window - 1``), where both agree.
    """
    found = []
    for section in (config, config.get("text_config") or {}):
        for key in ("sliding_window", "attention_window", "window_size"):
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
    return min(found) if found else None


def _check_window(source: Path, config: dict[str, Any], criterion: Criterion, prompt_len: int = 8) -> None:
    """Refuse, before converting, a window too short for the default prompts plus one step."""
    window = sliding_window(config)
    if window is not None and window - 1 - prompt_len < 1:
        raise ConfigError(f"{criterion} generates past the sliding window of {source} ({window} tokens): the "
                          f"default prompts are {prompt_len} tokens", "drop the token_agreement/ppl_delta criteria "
                          "for this model, or check it with amplite.llm.checkpoint.verify_checkpoint(..., "
                          "prompts=shorter)")  # fmt: skip


def _load(path: Path, dtype: torch.dtype | str) -> torch.nn.Module:
    import transformers
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # amplite's own progress goes to stderr; transformers' per-load bar does not
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"transformers cannot load {path} as a causal LM: {str(exc).splitlines()[0]}",
                          "check the directory with `amplite inspect DIR`, or drop the token_agreement/ppl_delta "
                          "criteria") from None  # fmt: skip
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def verify_checkpoint(
    source: str | Path,
    converted: str | Path,
    *,
    criteria: list[Criterion] | None = None,
    steps: int = 32,
    prompts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    eval_ids: torch.Tensor | None = None,
    fp8_activations: Activations = "stored",
) -> LLMMetrics:
    """Token agreement and perplexity delta of the converted directory against the source in FP32.

    Args:
        source: The original checkpoint directory (loaded in FP32: a bf16 source is up-cast, exactly).
        converted: A safetensors directory amplite wrote (loaded in the dtype its ``config.json`` names).
        criteria: ``token_agreement``/``ppl_delta`` criteria (default ``token_agreement>=0.99``, ``ppl_delta<=1%``).
        steps: Greedy steps per prompt.
        prompts, attention_mask, eval_ids: As for :func:`amplite.llm.verify_llm`.
        fp8_activations: For an FP8 directory, how its linears' inputs are quantized
            (:func:`amplite.checkpoint.fp8_model.load_fp8_model`; it cannot run in FP8 on this CPU).

    Returns:
        The metrics, judged (``seconds`` covers both models).

    Raises:
        ConfigError: A directory transformers cannot load as a causal LM, or bad prompts.
    """
    start = perf_counter()
    chosen = criteria or [parse_criterion("token_agreement>=0.99"), parse_criterion("ppl_delta<=1%")]
    reference = _load(Path(source), torch.float32)
    vocab = int(reference.get_output_embeddings().weight.shape[0])
    ids, mask = (prompts, attention_mask) if prompts is not None else default_prompts(vocab)
    ids, mask = prepare(ids, mask)
    evals = default_eval_ids(vocab) if eval_ids is None else prepare(eval_ids, None)[0]
    window = sliding_window(reference.config.to_dict())
    if window is not None:  # sized to the window: within it, sliding attention is full attention
        steps = min(steps, window - 1 - ids.shape[1])
        evals = evals[:, : window - 1]
        if steps < 1:
            raise ConfigError(f"the generation check needs prompts of {ids.shape[1]} tokens plus one step inside the "
                              f"model's sliding window of {window}", "pass shorter prompts, or drop the "
                              "token_agreement/ppl_delta criteria")  # fmt: skip
    with amplite_attention(reference):
        step = LMStep(reference, torch.float32)
        ref = reference_run(Runner(step, step.shape, torch.float32), ids, mask, steps, evals)
    del reference, step
    gc.collect()  # the FP32 model goes before the converted one is loaded: one model in memory at a time
    fp8 = is_fp8_dir(converted)
    model = load_fp8_model(converted, fp8_activations) if fp8 else _load(Path(converted), "auto")
    dtype = next(model.parameters()).dtype
    with amplite_attention(model):
        step = LMStep(model, dtype)
        metrics = judge(ref, Runner(step, step.shape, dtype), ids, mask, evals, chosen)
    metrics.seconds = round(perf_counter() - start, 3)
    return metrics
