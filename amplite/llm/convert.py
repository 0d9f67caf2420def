"""``convert_llm``: a ``transformers`` causal LM to one converted step program (prefill + decode with a KV
cache, dynamic batch, prompt and cache length), verified on generation as well as on logits.

The program is :class:`~amplite.llm.step.LMStep` exported and converted by :func:`amplite.convert` with
``input_ids``/``attention_mask`` dims 0-1 and the cache's batch and length dims dynamic. The cache crosses
the program boundary in the low dtype when the plan runs attention in low precision (the cache then costs
half the memory and nothing in accuracy: attention would round it to that dtype anyway), else in FP32.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from amplite.api import convert_spec
from amplite.errors import ConfigError
from amplite.llm.generate import Runner, prepare
from amplite.llm.metrics import LLMMetrics, default_eval_ids, default_prompts, llm_criteria, measure
from amplite.llm.result import LLMProgram, LLMResult
from amplite.llm.step import LMStep, amplite_attention, cache_shape
from amplite.options import ConvertOptions
from amplite.options import Verification as VerifySettings
from amplite.policy import Level
from amplite.report.sections import Llm, Section, Timings, Verification
from amplite.spec import ConvertSpec
from amplite.verify.criteria import Tolerance, parse_tolerance

DYNAMIC_DIMS = {"input_ids": [0, 1], "attention_mask": [0, 1], "past_keys": [1, 3], "past_values": [1, 3]}
#: The conversion options the step program fixes itself (``ConvertOptions`` fields; a test checks the names).
FIXED_OPTIONS = ("dynamic_dims", "dynamic_batch", "low_precision_io", "calibration")
_ATTENTION_OPS = ("scaled_dot_product_attention",)


def convert_llm(
    model: nn.Module,
    *,
    precision: str | None = None,
    level: str | Level | None = None,
    cache_dtype: str = "auto",
    prompts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    steps: int = 32,
    eval_ids: torch.Tensor | None = None,
    tolerance: Sequence[str] | Tolerance | None = None,
    verify: bool = True,
    **options: Any,
) -> LLMResult:
    """Convert a ``transformers`` causal LM into a step program that generates with a KV cache.

    Args:
        model: A ``transformers`` ``*ForCausalLM`` in eval mode (not modified).
        precision: ``fp16`` or ``bf16`` (default bf16: :data:`amplite.spec.PATH_DEFAULTS`).
        level: ``O0``-``O3`` (default: ``AMPLITE_LEVEL``, else O2: weights stored low).
        cache_dtype: ``auto`` (low when the plan runs attention low, else FP32), ``fp32`` or ``low``.
        prompts: ``[N, S]`` token ids for the agreement check (left-padded, with ``attention_mask``);
            default 4 seeded random prompts of lengths 8 and 5.
        attention_mask: Mask of ``prompts`` (default all ones).
        steps: Greedy steps per prompt for the agreement check.
        eval_ids: ``[N, T]`` token set for perplexity (default 2 x 32 seeded random ids).
        tolerance: Criteria text (``["token_agreement>=0.99", "ppl_delta<=0.5%", "sqnr>=30"]``) or a
            :class:`Tolerance`; LLM criteria default to ``DEFAULT_LLM_CRITERIA[precision]``.
        verify: Verify logits (``amplite.convert``'s check of the step) and generation.
        **options: More :func:`amplite.convert` options (``keep_fp32``, ``force_low``, ``range_rules``, ...).

    Returns:
        The step program, its report (with an ``llm`` section: agreement, first divergence, perplexities)
        and ``generate``/``save``.

    Raises:
        ConfigError: Not a causal LM, options that do not fit (``dynamic_dims`` are set here), bad prompts.
    """
    for fixed in FIXED_OPTIONS:
        if fixed in options:
            raise ConfigError(
                f"convert_llm sets {fixed} itself", f"drop {fixed}: the step program's shapes are fixed by design"
            )
    opts = ConvertOptions.of(None, precision=precision, level=level, dynamic_dims=DYNAMIC_DIMS, verify=verify,
                             **options)  # fmt: skip
    spec = opts.spec("llm")  # an unknown name is a one-line error here, not a silent fp16
    if spec.fp8 is not None:
        raise ConfigError("convert_llm converts to fp16 or bf16, not fp8", "pass precision='bf16' (FP8 weights "
                          "for vLLM: amplite convert CHECKPOINT_DIR --precision fp8)")  # fmt: skip
    if model.training:
        raise ConfigError("the model is in train mode", "call model.eval() before converting it for generation")
    if cache_dtype not in ("auto", "fp32", "low"):
        raise ConfigError(f"unknown cache dtype {cache_dtype!r}", "use auto, fp32 or low")
    start = perf_counter()
    shape = cache_shape(model)
    tol = (
        tolerance
        if isinstance(tolerance, Tolerance) or tolerance is None
        else parse_tolerance(list(tolerance), spec.precision_name)
    )
    check = VerifySettings(verify, tol, opts.fallback_search, opts.max_trials)
    wanted = torch.float32 if cache_dtype == "fp32" or spec.level is Level.O0 else spec.precision
    with amplite_attention(model):
        result = _convert_step(model, wanted, spec, check)
        if cache_dtype == "auto" and wanted != torch.float32 and not _attention_low(result):
            wanted = torch.float32  # the plan keeps attention FP32: a low cache would round what it keeps exact
            result = _convert_step(model, wanted, spec, check)
        program = LLMProgram(result.program, shape, wanted)
        out = LLMResult(program, result)
        sections: list[Section] = []
        llm = Llm.of({"cache_dtype": str(wanted).removeprefix("torch."), "cache_shape": _shape_text(shape)})
        if verify:
            metrics = verify_llm(program, model, precision=spec.precision_name, tolerance=tol, prompts=prompts,
                                 attention_mask=attention_mask, steps=steps, eval_ids=eval_ids)  # fmt: skip
            out.metrics = metrics
            llm = llm.add(**metrics.to_dict())
            ver = result.report.section(Verification) or Verification.of([], tol)
            sections.append(ver.folded(metrics.passed))
        sections.append(llm)
    # the step program's sections join the report its conversion built (a new report: reports are frozen)
    timings = result.report.section(Timings).add(llm_total=perf_counter() - start)
    result.report = result.report.with_sections(*sections, timings)
    return out


def verify_llm(
    program: LLMProgram,
    model: nn.Module,
    *,
    precision: str = "bf16",
    tolerance: Sequence[str] | Tolerance | None = None,
    prompts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    steps: int = 32,
    eval_ids: torch.Tensor | None = None,
) -> LLMMetrics:
    """Token agreement and perplexity difference of a step program against the FP32 ``model``, judged by
    the LLM criteria of ``tolerance`` (default ``DEFAULT_LLM_CRITERIA[precision]``).

    Raises:
        ConfigError: Bad prompts, criteria or precision.
    """
    tol = (
        tolerance
        if isinstance(tolerance, Tolerance) or tolerance is None
        else parse_tolerance(list(tolerance), precision)
    )
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids, mask = (prompts, attention_mask) if prompts is not None else default_prompts(vocab)
    ids, mask = prepare(ids, mask)
    evals = default_eval_ids(vocab) if eval_ids is None else prepare(eval_ids, None)[0]
    start = perf_counter()
    with amplite_attention(model):
        reference = Runner(LMStep(model, torch.float32), program.shape, torch.float32)
        metrics = measure(reference, program.runner(), ids, mask, steps, evals, llm_criteria(tol, precision))
    metrics.seconds = round(perf_counter() - start, 3)
    return metrics


def _convert_step(model: nn.Module, cache: torch.dtype, spec: ConvertSpec, check: VerifySettings) -> Any:
    """Export and convert :class:`LMStep` on a real example: a 4-token prefill's cache, then 3 new tokens."""
    step = LMStep(model, cache)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    device = next(model.parameters()).device  # the example lives where the weights do (a CUDA model too)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        empty = step.shape.empty(2, cache, device)
        ids = torch.randint(0, vocab, (2, 4), generator=g, device=device)
        _, keys, values = step(ids, torch.ones(2, 4, dtype=torch.long, device=device), empty, empty)
    new = torch.randint(0, vocab, (2, 3), generator=g, device=device)
    example = (new, torch.ones(2, 7, dtype=torch.long, device=device), keys, values)
    # Size-oblivious tracing: the program must serve batch 1, one-token decode steps and an empty cache.
    with fx_config.patch(backed_size_oblivious=True):
        return convert_spec(step, example, spec, check)


def _attention_low(result: Any) -> bool:
    """Whether the plan runs every attention op in low precision (no attention op: True)."""
    modes = [e.mode for e in result.report.planned if any(a in str(e.op) for a in _ATTENTION_OPS)]
    return all(m == "low" for m in modes)


def _shape_text(shape: Any) -> str:
    return f"[layers={shape.layers}, batch, kv_heads={shape.kv_heads}, length, head_dim={shape.head_dim}]"
