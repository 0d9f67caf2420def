"""What ``amplite.check`` is asked to do, besides converting: :class:`CheckSettings`, one frozen value.

``check``'s own keywords are this dataclass's fields (its shown signature is generated from them and from
``amplite.ConvertOptions``); a keyword that names neither is a one-line ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.verify.compare import Tolerance


@dataclass(frozen=True)
class CheckSettings:
    """The gate's settings.

    Attributes:
        converted: A converted .pt2 to check instead of converting now.
        golden: A golden directory: its inputs are the data and its outputs the reference.
        update_golden: (Re)write ``golden`` from the FP32 model first.
        baseline: An accepted earlier report.json (path or dict); worse metrics beyond the margin fail.
        baseline_margin_db: Allowed loss: SQNR may drop this many dB, errors grow by the same ratio.
        tolerance: A Tolerance or ``--tolerance`` strings (``sqnr>=45``, ``logits:top1>=0.999``).
        data: Directory of batch files.
        data_loader: ``module:function`` yielding batches.
        random_batches: Number of seeded random batches (from ``input_specs`` or the example's shapes).
        input_specs: ``--input`` specs, for random batches.
        max_batches: At most this many batches are used.
        layerwise: Localise the error node by node (first batch).
        grad: Also compare parameter gradients of one backward pass (``loss`` or sum of outputs).
        loss: ``module:function(outputs) -> loss`` (or the callable) for ``grad``.
        report_dir: Write report.json, report.md and report.html here (created if missing).
        junit: Write a JUnit XML file here.
        name: Model name for JUnit/annotations (default: the file stem or class name).
        train_steps: Instead of verifying outputs, train an FP32 and an amplite copy this many steps and gate
            on ``train_loss_gap`` (:mod:`amplite.training.gate`).
        lr: Their AdamW learning rate.
        inputs_file: The file ``example_inputs`` were read from, if any (no output may overwrite it).
    """

    converted: str | Path | ExportedProgram | None = None
    golden: str | Path | None = None
    update_golden: bool = False
    baseline: str | Path | dict[str, Any] | None = None
    baseline_margin_db: float = 1.0
    tolerance: Tolerance | Sequence[str] | None = None
    data: str | Path | None = None
    data_loader: str | None = None
    random_batches: int = 0
    input_specs: Sequence[str] = ()
    max_batches: int = 64
    layerwise: bool = True
    grad: bool = False
    loss: str | Callable[[Any], torch.Tensor] | None = None
    report_dir: str | Path | None = None
    junit: str | Path | None = None
    name: str | None = None
    train_steps: int = 0
    lr: float = 1e-3
    inputs_file: str | Path | None = None

    @classmethod
    def split(
        cls, settings: CheckSettings | None, options: ConvertOptions | None, changes: dict[str, Any]
    ) -> tuple[CheckSettings, ConvertOptions]:
        """``check``'s keywords: its own (these fields: ``tolerance`` is the gate's) over ``settings``, the
        conversion options over ``options``; a name that is neither is a ``ConfigError``."""
        if settings is not None and not isinstance(settings, CheckSettings):
            raise ConfigError(f"settings= is a {type(settings).__name__}, not CheckSettings",
                              "pass amplite.gate.CheckSettings(...), or the settings as keywords")  # fmt: skip
        own = {f.name for f in fields(cls)}
        mine = {k: v for k, v in changes.items() if k in own}
        return replace(settings or cls(), **mine), ConvertOptions.of(options, **{k: v for k, v in changes.items()
                                                                                 if k not in own})  # fmt: skip

    @property
    def has_data(self) -> bool:
        """Batches come from a directory, a loader or ``--input`` specs (not from the golden directory)."""
        return self.data is not None or self.data_loader is not None or bool(self.random_batches and self.input_specs)

    def refuse_for(self, what: str, names: dict[str, str], fix: str) -> None:
        """Refuse the settings in ``names`` (field -> flag) that are set, for a path that has no use for them."""
        given = [flag for field, flag in names.items() if getattr(self, field)]
        if given:
            raise ConfigError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to {what}", fix)

    def batches(self, example: Any) -> list:
        """The data batches (from the example's shapes for random ones when no spec is given)."""
        from amplite.verify import data as data_mod

        return data_mod.select_batches(example, self.data, self.data_loader, self.random_batches, self.input_specs,
                                       self.max_batches)  # fmt: skip


def check_signature(func: Any) -> Any:
    """``func``'s shown signature: its own parameters, then every CheckSettings field and conversion option."""
    import inspect

    from amplite.options import keyword_signature

    sig = keyword_signature(func, after="options")
    params = list(sig.parameters.values())
    at = next(i for i, p in enumerate(params) if p.name == "options")
    own = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
           for f in fields(CheckSettings)]  # fmt: skip
    shadowed = {f.name for f in fields(CheckSettings)}
    rest = [p for p in params[at + 1 :] if p.name not in shadowed]
    return sig.replace(parameters=[*params[: at + 1], *own, *rest])
