"""amplite's Lightning precision plugin: examples/train_lightning.py against Lightning's own bf16-mixed/16-mixed.

Tiny GPT-2 (transformers' class from a config), synthetic fixed-length batches, CPU: each Trainer run takes
a few seconds.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from amplite.errors import AmpliteError  # noqa: E402
from amplite.integrations.lightning import AmplitePrecision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_lightning", ROOT / "examples" / "train_lightning.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _model(cls=None) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)  # the same initial weights for every run
    return (cls or ex.TinyGPT)()


def _fit(model, precision: dict, epochs: int, **trainer_kw) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    train = torch.utils.data.DataLoader(ex.token_data(ex.BATCH * ex.BATCHES, seed=0), batch_size=ex.BATCH)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, **precision, **trainer_kw)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train)
    return trainer


def test_example_matches_bf16_mixed_then_checkpoints_reload_and_resume(tmp_path):
    ours = ex.run(str(tmp_path / "amp"), "amplite", epochs=3)
    auto = ex.run(str(tmp_path / "auto"), "bf16-mixed", epochs=3)
    fp32 = ex.run(str(tmp_path / "fp32"), "32-true", epochs=1)
    assert len(ours.losses) == len(auto.losses) == 30
    assert _rel(ours.losses, auto.losses) < 0.01  # every step within 1 % of Lightning's own bf16-mixed
    assert ours.losses[-1] < 0.85 * ours.losses[0]  # it learns
    assert ours.losses[:10] != fp32.losses  # and it is not an FP32 run in disguise
    assert "forward" not in ours.__dict__  # teardown gave the module its own forward back

    ckpt = torch.load(tmp_path / "amp" / "epoch=1.ckpt", weights_only=False)
    assert ckpt["AmplitePrecision"] == {"scaler": None, "steps": 20}
    assert {v.dtype for v in ckpt["state_dict"].values()} == {torch.float32}  # the FP32 masters

    # reload: Lightning's own loader gives the trained FP32 weights
    last = ex.TinyGPT.load_from_checkpoint(tmp_path / "amp" / "last.ckpt")
    trained = ours.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in last.state_dict().items())

    # resume from epoch 2's checkpoint in a fresh Trainer and model: the last 10 steps repeat
    resumed = ex.run(str(tmp_path / "resumed"), "amplite", epochs=3, resume=str(tmp_path / "amp" / "epoch=1.ckpt"))
    assert len(resumed.losses) == 10
    assert _rel(resumed.losses, ours.losses[20:]) < 1e-5
    assert torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=False)["AmplitePrecision"]["steps"] == 30


def test_plugin_converts_lazily_and_clips_the_fp32_masters():
    norms: list[float] = []

    class Norms(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            assert all(g.dtype == torch.float32 for g in grads)
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    plugin = AmplitePrecision("bf16", level="O2")
    model = _model()
    assert plugin.net is None
    _fit(model, {"plugins": [plugin]}, 1, gradient_clip_val=0.05, callbacks=[Norms()])
    assert plugin.net.info["level"] == "O2" and plugin.net.info["low_copies"] > 0
    # the net's parameters are the model's (FP32 masters); the graphs read cached bf16 copies of them
    assert {id(p) for p in plugin.net.parameters()} == {id(p) for p in model.parameters()}
    low = [c for c, _ in plugin.amp.opt.pairs if c.dtype == torch.bfloat16]
    assert low and all(p.data_ptr() != q.data_ptr() for p in low for q in model.parameters())
    assert len(norms) == 10 and max(norms) <= 0.05 * 1.001  # Trainer(gradient_clip_val) clipped the masters


def test_fp16_with_accumulation_matches_16_mixed_and_saves_the_loss_scale(tmp_path):
    plugin = AmplitePrecision("fp16", level="O2")
    ours, auto = _model(), _model()
    _fit(ours, {"plugins": [plugin]}, 1, accumulate_grad_batches=2, gradient_clip_val=1.0)
    # Lightning turns precision="16-mixed" into bf16 on CPU; its plugin object runs fp16 autocast + GradScaler
    autocast = MixedPrecision("16-mixed", "cpu")
    trainer = _fit(auto, {"plugins": [autocast]}, 1, accumulate_grad_batches=2, gradient_clip_val=1.0)
    assert len(ours.losses) == 10 and _rel(ours.losses, auto.losses) < 0.01
    assert plugin.amp.opt.steps == 5  # 10 batches, 2 backwards per step
    state = plugin.state_dict()
    assert state["scaler"]["scale"] == autocast.scaler.get_scale() == 2.0**16
    assert trainer.precision_plugin is autocast


def test_a_training_step_that_bypasses_forward_is_an_error_or_named():
    class Direct(ex.TinyGPT):
        def forward(self, ids):  # never used by training_step below
            raise AssertionError

        def _loss(self, ids):
            logits = self.gpt(input_ids=ids).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    with pytest.raises(AmpliteError, match=r"never called self\(\.\.\.\)"):
        _fit(_model(Direct), {"plugins": [AmplitePrecision("bf16", level="O2")]}, 1)
    plugin = AmplitePrecision("bf16", level="O2", module="gpt")
    _fit(_model(Direct), {"plugins": [plugin]}, 1)  # naming the submodule converts it
    assert plugin.net is not None and plugin.net.info["low_copies"] > 0
    with pytest.raises(AmpliteError, match="no such submodule"):
        _fit(_model(Direct), {"plugins": [AmplitePrecision("bf16", module="nope")]}, 1)
    with pytest.raises(AmpliteError, match="precision 'fp8'"):
        AmplitePrecision("fp8")
