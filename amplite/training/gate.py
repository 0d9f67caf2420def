"""``amplite check --train-steps N``: train an FP32 copy and an amplite copy side by side and gate on the gap.

Both copies start from the user's weights (deep copies: the user's model does not change), see the same
batches in the same order and the same random numbers (the global seed is set before every forward, so
dropout masks match), and step with AdamW at the same learning rate. The logged loss is the mean over a
window of ``log_every`` steps; the gate is ``train_loss_gap<=X`` (default 0.02): at every logged step
``|amplite - fp32| / |fp32|`` must be at most X, and every amplite loss finite.

Batches: whatever ``--data``/``--data-loader`` yield (or the example inputs, repeated). A batch that is a
dict ``{"inputs": ..., "target": ...}`` (or whose keyword inputs hold a ``target`` that ``forward`` does not
take) brings its target: integer targets give cross-entropy, float targets MSE; without a target the loss is
the MSE against a seeded random target shaped like the output (the same for both copies).
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import warnings
from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from amplite.converter.graph_stats import graph_stats
from amplite.converter.inputs import normalize_inputs
from amplite.converter.loading import load_any
from amplite.describe import summarize_exception
from amplite.errors import ConfigError, InputSpecError
from amplite.options import ConvertOptions
from amplite.policy import RuleSource
from amplite.report.document import Report, build_report
from amplite.report.sections import Training
from amplite.spec import ConvertSpec
from amplite.training.prepare import for_training, prepare_spec
from amplite.verify.numbers import decode_float, encode_float

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
DEFAULT_GAP = 0.02
_GAP = re.compile(r"^\s*train_loss_gap\s*(<=|<)\s*([0-9.eE+-]+)\s*$")


def parse_gap(tolerance: Sequence[str] | None) -> float:
    """The ``train_loss_gap<=X`` criterion among ``tolerance`` (default 0.02).

    Raises:
        ConfigError: Any other criterion (the training gate judges the loss curves only) or a bad value.
    """
    if tolerance is not None and not isinstance(tolerance, (list, tuple)):
        raise ConfigError("a training check takes --tolerance strings", "pass e.g. ['train_loss_gap<=0.02']")
    gap = DEFAULT_GAP
    for text in tolerance or ():
        m = _GAP.match(text)
        if not m:
            raise ConfigError(
                f"--tolerance {text!r} does not apply to a training check",
                "with --train-steps use train_loss_gap<=X (the relative loss gap at each logged step)",
            )
        gap = float(m.group(2))
    return gap


def split_target(model: nn.Module, batch: Inputs) -> tuple[Inputs, torch.Tensor | None]:
    """Separate a batch's target from the model's inputs (see the module docstring)."""
    args, kwargs = batch
    if not args and set(kwargs) == {"inputs", "target"}:
        inner = normalize_inputs(kwargs["inputs"])
        return inner, kwargs["target"]
    if "target" in kwargs and "target" not in inspect.signature(model.forward).parameters:
        rest = {k: v for k, v in kwargs.items() if k != "target"}
        return (args, rest), kwargs["target"]
    return batch, None


def first_float(out: Any) -> torch.Tensor:
    """The output the loss is computed on: the first floating-point tensor leaf."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise InputSpecError("the model returns no floating-point tensor to train on", "return logits or predictions")


def own_loss(out: Any) -> torch.Tensor | None:
    """The loss the model computed itself (``out.loss`` / ``out["loss"]``, as transformers models return)."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point() else None


def loss_of(out: Any, target: torch.Tensor | None, seed: int) -> tuple[torch.Tensor, str]:
    """The loss of one step and its name: the model's own loss when it returns one and no target is given."""
    if target is None and (own := own_loss(out)) is not None:
        return own.float(), "the model's own loss"
    y = first_float(out).float()
    if target is None:
        g = torch.Generator().manual_seed(seed)
        return F.mse_loss(y, torch.randn(y.shape, generator=g)), "mse vs seeded random target"
    if not target.is_floating_point():
        logits = y if y.dim() == 2 else y.movedim(-1, 1)
        return F.cross_entropy(logits, target), "cross_entropy"
    return F.mse_loss(y, target.float()), "mse"


def train_check(
    model: Any,
    example_inputs: Any,
    batches: list[tuple[str, Inputs]],
    *,
    steps: int,
    lr: float = 1e-3,
    tolerance: Sequence[str] | None = None,
    seed: int = 0,
    inputs_description: str = "example inputs",
    options: ConvertOptions | None = None,
    **changes: Any,
) -> tuple[Report, list[str]]:
    """Run the training gate.

    Of the conversion options (``options``, ``**changes``) training uses the precision, the level, the
    override patterns and how to read the model file; any other one given is refused (it would be ignored).

    Returns:
        The report (with its ``training`` section) and the failure reasons (empty: pass).

    Raises:
        AmpliteError: A model that is not an nn.Module, bad options or batches, a non-finite FP32 loss.
    """
    if steps < 1:
        raise ConfigError(f"--train-steps {steps} must be at least 1", "pass the number of steps to train")
    if not lr > 0:
        raise ConfigError(f"--lr {lr} must be positive", "pass a learning rate such as 1e-3")
    opts = ConvertOptions.of(options, **changes).only_for("training")
    spec = for_training(opts.spec("training"))  # validated before any work
    gap_limit = parse_gap(tolerance)
    loaded = load_any(model, trust_pickle=opts.trust_pickle, model_factory=opts.model_factory,
                      import_modules=opts.import_modules)  # fmt: skip
    if loaded.module is None:
        raise InputSpecError(
            f"a {loaded.kind} file holds no trainable module", "pass a state dict with --model-factory or a module"
        )
    user = loaded.module
    pairs = [split_target(user, b) for _, b in batches]
    if not pairs:
        example = normalize_inputs(example_inputs)
        if example is None:
            raise InputSpecError(
                "no batches to train on", "pass --data DIR, --data-loader module:function or example inputs (--input)"
            )
        pairs = [split_target(user, example)]
    start = perf_counter()
    ref, sub = copy.deepcopy(user).train(), copy.deepcopy(user).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    sub_opt = torch.optim.AdamW(sub.parameters(), lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net, opt = prepare_spec(sub, sub_opt, pairs[0][0], spec)
    prepare_s = perf_counter() - start

    start = perf_counter()
    fp32_curve: list[float] = []
    amp_curve: list[float] = []
    names = [n for n, _ in sub.named_parameters()]
    under = dict.fromkeys(names, 0.0)
    under_max = dict.fromkeys(names, 0.0)
    counted = 0
    loss_name = ""
    for step in range(steps):
        (args, kwargs), target = pairs[step % len(pairs)]
        torch.manual_seed(seed + step)
        try:  # the FP32 model is the user's own: what fails there is the batch's (or the model's) fault
            loss, loss_name = loss_of(ref(*args, **kwargs), target, seed + step)
        except Exception as exc:
            raise InputSpecError(
                f"batch {step % len(pairs)} (step {step}) does not fit the model: {summarize_exception(exc)}",
                "give batches with the dtypes and ranks forward() expects (sizes may change between batches)",
            ) from exc
        loss.backward()
        fp32_curve.append(loss.item())
        if not math.isfinite(fp32_curve[-1]):
            raise InputSpecError(
                f"the FP32 model's loss is {fp32_curve[-1]} at step {step}: there is nothing to compare with",
                "lower --lr or fix the model/data so that FP32 training is finite",
            )
        torch.manual_seed(seed + step)
        amp_loss, _ = loss_of(net(*args, **kwargs), target, seed + step)
        opt.backward(amp_loss)
        opt.unscale_()
        grads_ok = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in sub.parameters())
        if grads_ok:
            counted += 1
            for (name, p), q in zip(sub.named_parameters(), ref.parameters(), strict=True):
                if p.grad is None or q.grad is None:
                    continue
                share = float(((q.grad != 0) & (p.grad == 0)).sum()) / max(1, q.grad.numel())
                under[name] += share
                under_max[name] = max(under_max[name], share)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        amp_curve.append(amp_loss.item())
    train_s = perf_counter() - start

    log_every = max(1, steps // 20)
    logged, worst = [], 0.0
    ends = [*range(log_every, steps + 1, log_every)]
    if ends[-1] != steps:  # the last steps % log_every steps form a window of their own
        ends.append(steps)
    for begin, end in zip([0, *ends[:-1]], ends, strict=True):
        a = sum(amp_curve[begin:end]) / (end - begin)
        f = sum(fp32_curve[begin:end]) / (end - begin)
        gap = abs(a - f) / max(abs(f), 1e-12) if math.isfinite(a) else math.inf
        worst = max(worst, gap)
        logged.append({"step": end, "fp32": f, "amplite": encode_float(a), "gap": encode_float(gap)})
    reasons = []
    bad = [e["step"] for e in logged if not decode_float(e["gap"]) <= gap_limit]  # NaN/inf count as beyond
    if bad:
        reasons.append(
            f"train_loss_gap: {len(bad)} of {len(logged)} logged steps beyond {gap_limit} (first at step {bad[0]}, "
            f"max gap {_fmt_gap(worst)})"
        )
    non_finite = [i for i, v in enumerate(amp_curve) if not math.isfinite(v)]
    if non_finite:
        reasons.append(f"the amplite loss is not finite at {len(non_finite)} of {steps} steps (first at step "
                       f"{non_finite[0] + 1})")  # fmt: skip
    skipped = list(opt.scaler.skipped) if opt.scaler else []
    if skipped and len(skipped) == steps:
        reasons.append(f"every one of the {steps} steps was skipped for non-finite gradients")
    section = {
        "steps": steps,
        "lr": lr,
        "optimizer": "AdamW",
        "seed": seed,
        "loss": loss_name,
        "inputs": inputs_description,
        "batches": len(pairs),
        "precision": spec.precision_name,
        "level": spec.level.value,
        "masters": net.info["masters"],
        "low_copies": net.info["low_copies"],
        "tolerance": {"train_loss_gap": gap_limit},
        "log_every": log_every,
        "max_gap": encode_float(worst),
        "passed": not reasons,
        "fp32_losses": fp32_curve,
        "amplite_losses": [encode_float(v) for v in amp_curve],
        "logged": logged,
        "skipped_steps": skipped,
        "loss_scale_history": list(opt.scaler.history) if opt.scaler else [],
        "gradient_underflow": sorted(
            (
                {"parameter": n, "mean_share": under[n] / counted if counted else 0.0, "max_share": under_max[n]}
                for n in names
            ),
            key=lambda e: -e["mean_share"],
        ),
        "seconds": {"prepare": round(prepare_s, 4), "train": round(train_s, 4)},
    }
    return _document(loaded, net, spec, caught, section), reasons


def _document(loaded: Any, net: Any, spec: ConvertSpec, caught: list, training: dict[str, Any]) -> Report:
    """The gate's report, built once: the common fields, from the train-mode program and the rewritten graph,
    and the ``training`` section (its phase times are the report's ``timings``)."""
    low = spec.precision
    after = sum(t.nbytes for t in {id(t): t for t in [*net.parameters(), *net.buffers()]}.values())
    user = [r for r in spec.overrides if r.source is RuleSource.USER]  # training's own pins are not the user's
    config = {
        "precision": spec.precision_name,
        "level": spec.level.value,
        "level_source": spec.level_source,
        "keep_fp32": [r.pattern for r in user if r.action == "keep_fp32"],
        "force_low": [r.pattern for r in user if r.action == "force_low"],
        "low_precision_io": False,
        "dynamic_batch": True,
        "fuse_contractions": False,
        "range_rules": None,
        "fold_batchnorm": False,
        "mode": "training",
    }
    return build_report(
        source={"path": loaded.path, "format": loaded.kind},
        config=config,
        records=net.info["records"],
        plan=net.info["plan"],
        stats_before=net.info["graph_before"],
        stats_after=graph_stats(net.graph_module.graph, low),
        weights=(net.info["weight_bytes_before"], after),
        metrics=None,
        tolerance=None,
        timings=training["seconds"],
        warnings=[str(w.message) for w in caught],
        extra=[Training.of(training)],
    )


def _fmt_gap(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.4g}"
