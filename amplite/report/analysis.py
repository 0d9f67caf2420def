"""The report sections of the analyses: layer-wise error, activation ranges, gradients, training, the
generation check of an LLM, an FP8 checkpoint's facts and the GPU-time estimate.

Typed as :mod:`amplite.report.sections` describes; numbers that may be non-finite are :data:`Num`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from amplite.report.entries import CriterionCheck, NodeError
from amplite.report.format import PLAIN, Style, fmt
from amplite.report.typed import Entry, Num, Section

__all__ = ["Decision", "Estimate", "Fp8Checkpoint", "GradientUnderflow", "Gradients", "LayerError", "Layerwise",
           "Llm", "LossEntry", "ParameterError", "Ranges", "Training", "UnderflowShare"]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Decision(Entry):
    """A discrete-output node (argmax, comparison...) and how often both models agree on it."""

    node: str | None = None
    op: str | None = None
    module: str | None = None
    source: str | None = None
    elements: int | None = None
    agreement: float | None = None


@dataclass(frozen=True, kw_only=True)
class LayerError(Entry):
    """The worst accumulated and isolated error of one layer's nodes."""

    layer: str | None = None
    nodes: int | None = None
    accumulated_sqnr_db: Num | None = None
    isolated_sqnr_db: Num | None = None
    nonfinite: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Layerwise(Section):
    """``layerwise``: the error localised node by node (amplite.verify.layerwise)."""

    key = "layerwise"
    batch: int | None = None
    paired_nodes: int | None = None
    unpaired_converted_nodes: Sequence[str] | None = None
    seconds: float | None = None
    top_introducers: tuple[NodeError, ...] | None = None
    decisions: tuple[Decision, ...] | None = None
    layers: tuple[LayerError, ...] | None = None
    nodes: tuple[NodeError, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Ranges(Section):
    """``ranges``: activation ranges against the low dtype (amplite.verify.ranges)."""

    key = "ranges"
    dtype: str | None = None
    dtype_max: float | None = None
    dtype_smallest_normal: float | None = None
    nodes: int | None = None
    overflowing_nodes: Sequence[str] | None = None
    flushing_nodes: Sequence[str] | None = None
    max_abs: Num | None = None


@dataclass(frozen=True, kw_only=True)
class ParameterError(Entry):
    """One parameter's gradient against the FP32 one."""

    parameter: str | None = None
    dtype: str | None = None
    sqnr_db: Num | None = None
    max_abs: Num | None = None
    rel_l2: Num | None = None
    new_nonfinite: int | None = None


@dataclass(frozen=True, kw_only=True)
class GradientUnderflow(Entry):
    """How many gradient values underflow the low dtype, with and without loss scaling."""

    dtype: str | None = None
    values: int | None = None
    nonzero_fraction: float | None = None
    max_abs: Num | None = None
    underflow_unscaled: float | None = None
    subnormal_unscaled: float | None = None
    recommended_loss_scale: float | None = None
    advice: str | None = None
    underflow_scaled: float | None = None
    subnormal_scaled: float | None = None


@dataclass(frozen=True, kw_only=True)
class Gradients(Section):
    """``gradients``: parameter gradients of one backward pass (amplite.verify.gradcheck)."""

    key = "gradients"
    loss: str | None = None
    reference_loss: Num | None = None
    converted_loss: Num | None = None
    parameters: int | None = None
    min_sqnr_db: Num | None = None
    median_sqnr_db: Num | None = None
    worst: tuple[ParameterError, ...] | None = None
    nonfinite_parameters: Sequence[str] | None = None
    missing_gradients: Sequence[str] | None = None
    graph: str | None = None
    hint: str | None = None
    underflow: GradientUnderflow | None = None
    passed: bool | None = None
    seconds: float | None = None

    def summary(self, style: Style = PLAIN) -> str:
        """The one sentence on the gradient check every renderer prints: what was compared, how well, the
        underflow and the loss-scale advice."""
        u = self.underflow or GradientUnderflow()
        missing = len(self.missing_gradients or [])
        advice = u.advice or f"loss scale {fmt(u.recommended_loss_scale)}"
        return (
            f"{style.strong('Gradients')} ({style.text(self.loss)}, {style.text(self.graph or 'as converted')}): "
            f"{self.parameters} parameters compared, {style.strong(f'{missing} missing') if missing else '0 missing'}; "
            f"min SQNR {style.num(self.min_sqnr_db)} dB, median {style.num(self.median_sqnr_db)} dB; "
            f"{style.num(100 * (u.underflow_unscaled or 0.0), 3)} % underflow in {style.text(u.dtype)} unscaled; "
            f"recommended: {style.text(advice)}."
        )


@dataclass(frozen=True, kw_only=True)
class LossEntry(Entry):
    """One logged training step: both losses and their gap."""

    step: int | None = None
    fp32: float | None = None
    amplite: Num | None = None
    gap: Num | None = None


@dataclass(frozen=True, kw_only=True)
class UnderflowShare(Entry):
    """One parameter's share of gradient elements that underflow in training."""

    parameter: str | None = None
    mean_share: float | None = None
    max_share: float | None = None


@dataclass(frozen=True, kw_only=True)
class Training(Section):
    """``training``: ``check --train-steps``'s two training runs."""

    key = "training"
    steps: int | None = None
    lr: float | None = None
    optimizer: str | None = None
    seed: int | None = None
    loss: str | None = None
    inputs: str | None = None
    batches: int | None = None
    precision: str | None = None
    level: str | None = None
    masters: str | None = None
    low_copies: int | None = None
    tolerance: Mapping[str, float] | None = None
    log_every: int | None = None
    max_gap: Num | None = None
    passed: bool | None = None
    fp32_losses: Sequence[float] | None = None
    amplite_losses: Sequence[Num] | None = None
    logged: tuple[LossEntry, ...] | None = None
    skipped_steps: Sequence[int] | None = None
    loss_scale_history: Sequence[float] | None = None
    gradient_underflow: tuple[UnderflowShare, ...] | None = None
    seconds: Mapping[str, float] | None = None

    @property
    def gap_limit(self) -> float | None:
        """The largest loss gap allowed (``train_loss_gap``)."""
        return (self.tolerance or {}).get("train_loss_gap")


@dataclass(frozen=True, kw_only=True)
class Llm(Section):
    """``llm``: the generation check and the KV cache (amplite.llm)."""

    key = "llm"
    cache_dtype: str | None = None
    cache_shape: str | None = None
    converted: str | None = None
    converted_dtype: str | None = None
    prompts: int | None = None
    steps: int | None = None
    prompt_lengths: Sequence[int] | None = None
    token_agreement: float | None = None
    agreeing_tokens: int | None = None
    first_divergence: Sequence[int | None] | None = None
    ppl_fp32: Num | None = None
    ppl_converted: Num | None = None
    ppl_delta: Num | None = None
    ppl_tokens: int | None = None
    passed: bool | None = None
    checks: tuple[CriterionCheck, ...] | None = None
    seconds: float | None = None
    peak_rss_bytes: int | None = None

    def add(self, **facts: Any) -> Llm:
        """This section with more facts (a key given again is replaced)."""
        return Llm.from_json({**self.to_json(), **facts})


@dataclass(frozen=True, kw_only=True)
class Fp8Checkpoint(Section):
    """``fp8_checkpoint``: what an FP8 checkpoint directory stores (amplite.checkpoint.fp8), its scales and size."""

    key = "fp8_checkpoint"
    layout: str | None = None
    activation_scheme: str | None = None
    weight_scales: str | None = None
    fp8_linears: int | None = None
    ignored_layers: Sequence[str] | None = None
    calibration: Mapping[str, int] | None = None
    bytes: int | None = None
    bf16_bytes: int | None = None
    size_vs_bf16: float | None = None
    verified_as: str | None = None


@dataclass(frozen=True, kw_only=True)
class Estimate(Section):
    """``estimate``: the roofline estimate of GPU time (amplite.estimate)."""

    key = "estimate"
    label: str | None = None
    device: str | None = None
    profile: Mapping[str, Any] | None = None
    tf32: bool | None = None
    seconds: Mapping[str, float] | None = None
    kernels: Mapping[str, Any] | None = None
    ratio_vs_fp32: float | None = None
    ratio_vs_autocast: float | None = None
    cast_share: float | None = None
    fp32_island_share: float | None = None
    autocast_casts: int | None = None
    top_nodes: Sequence[Mapping[str, Any]] | None = None
