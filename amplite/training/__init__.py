"""Mixed-precision training on the converted graph: ``prepare_training`` and the ``check --train-steps`` gate.

Modules: ``prepare`` (train-mode export, precision plan, masters and low copies), ``net`` (the trainable
module and its train/eval graphs), ``optim`` (the optimizer wrapper: master gradients, refresh, loss
scaling), ``scaler`` (dynamic loss scaling), ``gate`` (FP32 vs amplite training runs, the report section).
Layer: beside ``save``; imports ``api`` and below (``converter``, ``policy``, ``report``, ``errors``), never
``gate``, ``batch`` or the CLI.
"""

from __future__ import annotations

from amplite.training.net import TrainingNet
from amplite.training.optim import MixedPrecisionOptimizer, TrainingError
from amplite.training.prepare import prepare_training

__all__ = ["MixedPrecisionOptimizer", "TrainingError", "TrainingNet", "prepare_training"]
