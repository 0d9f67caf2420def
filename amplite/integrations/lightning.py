"""A Lightning precision plugin that trains through amplite: ``Trainer(plugins=[AmplitePrecision("bf16", "O2")])``.

Built on Lightning's ``Precision`` plugin API, in place of ``precision="bf16-mixed"`` (autocast):

- ``convert_module`` makes the LightningModule's ``forward`` (or the submodule named by ``module=``) lazy:
  the first call, with the trainer's optimizer set up and the module on its device, runs
  ``amplite.prepare_training`` on that batch; every call then runs the converted graph (train or eval
  graph, following the module's mode). ``teardown`` gives the module its own ``forward`` back.
- ``forward_context`` turns on no autocast: the precision plan is in the graph.
- ``backward`` is amplite's (scaled under fp16; low-copy gradients summed into the FP32 masters, so
  ``accumulate_grad_batches`` accumulates in FP32). ``optimizer_step`` runs the closure, unscales, lets
  Lightning clip (``gradient_clip_val``: the masters, via ``main_params``) and steps through amplite
  (skipping fp16 steps with inf/NaN, refreshing the low-precision copies).
- Under ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) the sharded module is
  entered before FSDP's hooks (:func:`~amplite.integrations._lazy.patch_call`), so it is traced and run as
  ``prepare_training`` does for a ``fully_shard``-ed model; FSDP1's ``FSDPStrategy`` and DeepSpeed are refused.
- ``state_dict``/``load_state_dict`` carry the loss scaler, so a Lightning checkpoint resumes it; the model's
  ``state_dict`` (the checkpoint's weights) is the FP32 masters and the optimizer state is the user's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
except ImportError as exc:  # an optional dependency: say which extra brings it
    raise ImportError("amplite.integrations.lightning needs Lightning: pip install 'amplite[lightning]'") from exc
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from amplite.errors import AmpliteError, ConfigError
from amplite.integrations._lazy import LazyAmplite, original_forward, patch_call, patch_forward
from amplite.training.distributed import fsdp_units


class AmplitePrecision(Precision):
    """amplite's mixed precision for ``lightning.pytorch.Trainer(plugins=[...])``.

    Args:
        precision: ``bf16`` or ``fp16`` (fp16 adds dynamic loss scaling).
        level: ``O1``/``O2``/``O3``/``O0``; None reads ``AMPLITE_LEVEL`` (else O1).
        module: Attribute path of the submodule to convert (``"model"`` for ``self.model``), for a
            ``training_step`` that calls a submodule rather than ``self(...)``; None: the LightningModule's
            own ``forward``. The optimizer must step only this module's parameters.
        keep_fp32: Extra keep-FP32 patterns (as for ``amplite.convert``).
        force_low: Extra force-low patterns.
    """

    def __init__(
        self,
        precision: str = "bf16",
        level: str | None = None,
        *,
        module: str | None = None,
        keep_fp32: tuple[str, ...] = (),
        force_low: tuple[str, ...] = (),
    ) -> None:
        self.amp = LazyAmplite(precision, level, keep_fp32, force_low)
        # Lightning reads ``precision`` (model summary, throughput): FP32 masters, low-precision compute.
        self.precision = "bf16-mixed" if self.amp.spec.precision is torch.bfloat16 else "16-mixed"
        self.module_name = module
        self._undo: Callable[[], None] | None = None

    # -- the model ---------------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Route the module's forward through amplite from the first batch on (in place: some strategies
        ignore the return value)."""
        target = self._target(module)
        if self._undo is not None:
            self._undo()
        lightning_module = module

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.amp.ready:
                optimizer = self._optimizer(lightning_module)
                if optimizer is None:  # not fitting (a model summary, predict before fit): the FP32 model
                    with original_forward(target):
                        return target(*args, **kwargs)
                with original_forward(target):
                    self.amp.prepare(target, optimizer, args, kwargs)
            return self.amp.forward(target, *args, **kwargs)

        # a fully_shard-ed target (ModelParallelStrategy's configure_model ran before this) is entered before
        # FSDP's hooks: they gather the root's parameters, which the trace and the graph's own call must see sharded
        patch = patch_call if fsdp_units(target) else patch_forward
        self._undo = patch(target, forward)
        return module

    def _target(self, module: nn.Module) -> nn.Module:
        if self.module_name is None:
            return module
        try:
            return module.get_submodule(self.module_name)
        except AttributeError as exc:
            raise ConfigError(
                f"AmplitePrecision(module={self.module_name!r}): the LightningModule has no such submodule",
                "pass the attribute path of the submodule training_step calls (e.g. module='model')",
            ) from exc

    def _optimizer(self, module: nn.Module) -> Optimizer | None:
        trainer = getattr(module, "_trainer", None)
        optimizers = list(trainer.optimizers) if trainer is not None else []
        if not optimizers:
            return None
        if len(optimizers) > 1:
            raise ConfigError(
                f"AmplitePrecision trains with one optimizer, configure_optimizers returned {len(optimizers)}",
                "return one optimizer (param groups can hold different learning rates)",
            )
        _refuse_sharded(trainer)
        opt = optimizers[0]
        return getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps the user's optimizer

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """No autocast: the converted graph already computes in the planned precisions."""
        yield

    # -- backward and the step ---------------------------------------------------------------------------
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """amplite's backward once traced (scaled under fp16, gradients into the masters), else Lightning's."""
        if self.amp.ready:
            self.amp.backward(tensor, *args, **kwargs)
        else:
            model.backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Closure (training_step + backward), unscale, Lightning's hooks and clipping, amplite's step."""
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: no backward, no step (as Lightning does)
        if not self.amp.ready:
            what = f"self.{self.module_name}(...)" if self.module_name else "self(...) (the LightningModule's forward)"
            raise AmpliteError(
                f"training_step never called {what}, which AmplitePrecision converts: the step would be FP32",
                "call self(batch) in training_step, or pass AmplitePrecision(module='model') naming the "
                "submodule it calls",
            )
        inner = getattr(optimizer, "_optimizer", optimizer)
        if inner is not self.amp.optimizer:
            raise AmpliteError("the optimizer stepped is not the one amplite was prepared with", "use one optimizer")
        self.amp.unscale_once()  # true FP32 gradients for on_before_optimizer_step and clipping
        self._after_closure(model, optimizer)
        self.amp.step()
        return closure_result

    def main_params(self, optimizer: Optimizer) -> Any:
        """The FP32 masters (the user's optimizer's parameters): what clipping clips."""
        return super().main_params(getattr(optimizer, "_optimizer", optimizer))

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler and step count; Lightning stores it in the checkpoint under this class's name."""
        return self.amp.amplite_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (applied at the first batch if the model is not traced yet)."""
        self.amp.load_amplite_state(state_dict)

    def teardown(self) -> None:
        """Give the module its own forward back (the net stays ready for a later fit/validate)."""
        if self._undo is not None:
            self._undo()
            self._undo = None

    @property
    def net(self) -> Any:
        """The converted :class:`~amplite.training.TrainingNet` (None before the first batch); ``net.info``
        holds the plan and the report facts."""
        return self.amp.net


def _refuse_sharded(trainer: Any) -> None:
    """DDP-style strategies train through the converted forward (the model DDP wraps calls it), and so does
    ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``, traced per unit). ``FSDPStrategy``
    (FSDP1) flattens the parameters into ``FlatParameter``s and re-wraps the module after ``configure_model``,
    handing the graph parameters it never read; DeepSpeed likewise."""
    name = type(getattr(trainer, "strategy", None)).__name__
    if "FSDP" in name or "DeepSpeed" in name:
        raise ConfigError(
            f"AmplitePrecision does not run under Lightning's {name}: it flattens and re-wraps the parameters "
            "the converted graph reads (FSDP1/DeepSpeed)",
            "shard with FSDP2 instead: strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) "
            "and fully_shard the layers and the converted module in configure_model (or use strategy='ddp')",
        )
