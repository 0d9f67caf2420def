"""What LLM users check: greedy next-token agreement with the FP32 model and the perplexity difference.

* **Token agreement** (teacher-forced): the FP32 model greedily continues each prompt for ``M`` steps; the
  converted program is fed the same prompt and, at every step, the FP32 model's token (not its own), and
  its greedy next token is compared with FP32's. One divergence therefore does not cascade: the share
  of identical next tokens over ``N x M`` positions is a per-token accuracy. ``first_divergence[n]`` is
  the first step where prompt ``n`` differs (``None``: never), which is also where free-running greedy
  decoding of the converted program first leaves FP32's text.
* **Perplexity** on a fixed token set (``exp`` of the mean next-token negative log-likelihood), FP32 and
  converted, each in one prefill; ``ppl_delta = |ppl_converted / ppl_fp32 - 1|`` (relative, both directions:
  a change either way means the model differs).

Criteria (``amplite.verify.criteria`` syntax): ``token_agreement>=0.99``, ``ppl_delta<=0.5%`` (``%``
divides by 100: ``ppl_delta<=0.005`` is the same).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from amplite.llm.generate import Runner, greedy, teacher_forced
from amplite.verify.criteria import Criterion, Tolerance, parse_criterion

#: Metrics judged here rather than on the program's outputs.
LLM_METRICS = frozenset({"token_agreement", "ppl_delta"})
#: Criteria applied when the user names none of :data:`LLM_METRICS`, by precision.
DEFAULT_LLM_CRITERIA: dict[str, tuple[str, ...]] = {
    "fp16": ("token_agreement>=0.98", "ppl_delta<=1%"),
    "bf16": ("token_agreement>=0.9", "ppl_delta<=2%"),
}


@dataclass
class LLMMetrics:
    """Agreement and perplexity of a converted LM against its FP32 model (see the module docstring)."""

    prompts: int
    steps: int
    prompt_lengths: list[int]
    token_agreement: float
    agreeing_tokens: int
    first_divergence: list[int | None]
    ppl_fp32: float
    ppl_converted: float
    ppl_delta: float
    ppl_tokens: int
    passed: bool = True
    checks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (non-finite floats as strings)."""
        return {k: (_json(v) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _json(v: float) -> float | str:
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def llm_criteria(tolerance: Tolerance | None, precision: str) -> list[Criterion]:
    """The LLM criteria of ``tolerance`` (unscoped ``token_agreement``/``ppl_delta``), else the defaults."""
    chosen = [
        c for c in (parse_criterion(t) for t in (tolerance.criteria if tolerance else ())) if c.metric in LLM_METRICS
    ]
    return chosen or [parse_criterion(t) for t in DEFAULT_LLM_CRITERIA[precision]]


def perplexity(runner: Runner, ids: torch.Tensor) -> float:
    """``exp`` of the mean next-token NLL of ``ids`` ``[N, T]`` (no padding), in one prefill."""
    ids = ids.to(runner.device)
    logits, _, _ = runner.prefill(ids, torch.ones_like(ids))
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].double().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    return float(torch.exp(nll))


@dataclass
class Reference:
    """What the FP32 model produced: its greedy continuations and its perplexity. Kept apart from the
    comparison so that the FP32 model can be dropped before the converted one is loaded."""

    tokens: torch.Tensor
    ppl: float


def reference_run(
    reference: Runner, prompts: torch.Tensor, attention_mask: torch.Tensor, steps: int, eval_ids: torch.Tensor
) -> Reference:
    """FP32's greedy ``steps`` tokens per prompt (``[N, steps]``) and its perplexity on ``eval_ids``."""
    tokens = greedy(reference, prompts, steps, attention_mask)[:, prompts.shape[1] :]
    return Reference(tokens, perplexity(reference, eval_ids))


def judge(
    ref: Reference,
    converted: Runner,
    prompts: torch.Tensor,
    attention_mask: torch.Tensor,
    eval_ids: torch.Tensor,
    criteria: list[Criterion],
) -> LLMMetrics:
    """Token agreement of ``converted`` with FP32's tokens (teacher-forced) and the perplexity difference, judged."""
    predicted, _ = teacher_forced(converted, prompts, attention_mask, ref.tokens)
    same = predicted.cpu() == ref.tokens.cpu()  # the FP32 reference may have run on another device
    first = [None if bool(row.all()) else int((~row).nonzero()[0, 0]) for row in same]
    ppl_out = perplexity(converted, eval_ids)
    delta = abs(ppl_out / ref.ppl - 1) if math.isfinite(ppl_out) and ref.ppl > 0 else math.inf
    m = LLMMetrics(
        prompts=int(prompts.shape[0]),
        steps=int(ref.tokens.shape[1]),
        prompt_lengths=[int(n) for n in attention_mask.sum(-1)],
        token_agreement=float(same.double().mean()),
        agreeing_tokens=int(same.sum()),
        first_divergence=first,
        ppl_fp32=ref.ppl,
        ppl_converted=ppl_out,
        ppl_delta=delta,
        ppl_tokens=int(eval_ids.numel()),
    )
    for c in criteria:
        value = float(getattr(m, c.metric))
        ok = c.holds(value)
        m.passed &= ok
        m.checks.append({"criterion": str(c), "value": _json(value), "passed": ok})
    return m


def measure(
    reference: Runner,
    converted: Runner,
    prompts: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int,
    eval_ids: torch.Tensor,
    criteria: list[Criterion],
) -> LLMMetrics:
    """Token agreement over ``prompts`` x ``steps`` and the perplexity difference on ``eval_ids``, judged."""
    ref = reference_run(reference, prompts, attention_mask, steps, eval_ids)
    return judge(ref, converted, prompts, attention_mask, eval_ids, criteria)


def failures(metrics: LLMMetrics) -> list[str]:
    """One line per failed criterion, naming metric and value (and where generation first diverged)."""
    diverged = [f"prompt {i + 1} at step {d}" for i, d in enumerate(metrics.first_divergence) if d is not None]
    where = f"; first divergence: {', '.join(diverged)}" if diverged else ""
    return [f"{c['criterion'].split('>')[0].split('<')[0]} = {c['value']} fails {c['criterion']}{where}"
            for c in metrics.checks if not c["passed"]]  # fmt: skip


def default_prompts(
    vocab: int, lengths: tuple[int, ...] = (8, 5), per_length: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random prompts of several lengths, left-padded into one batch: ``(ids, attention_mask)``.

    Made on the CPU on purpose (the same prompts whatever the device); the runner moves them once, at prefill.
    """
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths) * per_length, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(n for n in lengths for _ in range(per_length)):
        ids[i, width - n :] = torch.randint(0, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def default_eval_ids(vocab: int, rows: int = 2, length: int = 32, seed: int = 1) -> torch.Tensor:
    """The fixed token set perplexity is measured on when none is given (seeded random ids)."""
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
