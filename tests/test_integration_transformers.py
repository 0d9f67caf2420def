"""amplite's transformers Trainer: examples/train_transformers.py against the Trainer's own bf16=True.

Tiny GPT-2 from a config, synthetic fixed-length examples, CPU: each Trainer run takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from amplite.errors import AmpliteError  # noqa: E402
from amplite.integrations.transformers import AmpliteOptimizer, AmpliteTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_transformers", ROOT / "examples" / "train_transformers.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, use_cpu=True, seed=0, report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


def _train(trainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


STEPS, HALF = 20, 10  # the example's --steps: evaluated and checkpointed at HALF and at STEPS


def test_example_matches_bf16_true_then_saves_reloads_and_resumes(tmp_path):
    ours = ex.run(str(tmp_path / "amp"), "amplite", STEPS)
    auto = ex.run(str(tmp_path / "auto"), "bf16", STEPS)
    assert ours.args.bf16 is False and ours.args.mixed_precision == "no"  # autocast off in the Trainer's copy
    net = ours.amplite_net
    assert net.info["level"] == "O2" and net.info["low_copies"] > 0
    assert all(p.dtype == torch.float32 for p in net.parameters())  # the model's masters
    assert any(c.dtype == torch.bfloat16 for c, _ in ours.optimizer.optimizer.amp.opt.pairs)  # cached bf16 copies
    a, b = ex.losses(ours), ex.losses(auto)
    assert len(a) == STEPS and _rel(a, b) < 0.01  # every logged step within 1 % of the Trainer's bf16=True
    assert a[-1] < 0.92 * a[0]  # it learns: -10 % in 20 steps (the 50-step default reaches -15 %)
    evals = [[e["eval_loss"] for e in t.state.log_history if "eval_loss" in e] for t in (ours, auto)]
    assert len(evals[0]) == 2 and _rel(*evals) < 0.01  # evaluation through amplite's eval graph

    # save_model wrote the FP32 masters; from_pretrained loads them unchanged
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "amp" / "final")
    trained = ours.model.state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    state = torch.load(tmp_path / "amp" / f"checkpoint-{HALF}" / "optimizer.pt", weights_only=True)
    assert state["amplite"] == {"scaler": None, "steps": HALF}

    # resume in a fresh Trainer and model from the halfway checkpoint: the second half repeats
    resumed = ex.run(str(tmp_path / "amp2"), "amplite", STEPS, resume=str(tmp_path / "amp" / f"checkpoint-{HALF}"))
    again = ex.losses(resumed)  # the log history holds the first HALF steps from the checkpoint, then the new ones
    assert len(again) == STEPS and again[:HALF] == a[:HALF] and _rel(again[HALF:], a[HALF:]) < 1e-5
    assert isinstance(resumed.optimizer.optimizer, AmpliteOptimizer)
    assert resumed.optimizer.optimizer.amp.opt.steps == STEPS


def test_accumulation_and_clipping_act_on_the_fp32_masters(tmp_path):
    norms: list[float] = []

    class Norms(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):  # after clipping
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(g.dtype == torch.float32 for g in grads)
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    args = _args(tmp_path, gradient_accumulation_steps=3, max_grad_norm=0.05, bf16=True)
    trainer = AmpliteTrainer(ex.tiny_gpt2(), args, train_dataset=ex.TokenData(60, 0), callbacks=[Norms()],
                             amplite_level="O2")  # fmt: skip
    _train(trainer)
    assert args.bf16 is True  # the user's arguments are not changed
    assert len(norms) == 5 and max(norms) <= 0.05 * 1.001
    assert trainer.optimizer.optimizer.amp.opt.steps == 5  # 15 batches, 3 backwards per step
    assert all(g > 0.05 for g in [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e])


def test_fp16_true_means_amplite_fp16_with_loss_scaling(tmp_path):
    trainer = AmpliteTrainer(ex.tiny_gpt2(), _args(tmp_path, fp16=True), train_dataset=ex.TokenData(20, 0),
                             amplite_level="O2")  # fmt: skip
    _train(trainer)
    fp32 = transformers.Trainer(ex.tiny_gpt2(), _args(tmp_path), train_dataset=ex.TokenData(20, 0))
    _train(fp32)
    assert _rel(ex.losses(trainer), ex.losses(fp32)) < 0.01
    amp = trainer.optimizer.optimizer.amp
    assert amp.spec.precision is torch.float16 and amp.opt.loss_scale == 2.0**16
    assert any(c.dtype == torch.float16 for c, _ in amp.opt.pairs)
    assert trainer.optimizer.state_dict()["amplite"]["scaler"]["scale"] == 2.0**16


def test_a_compute_loss_that_bypasses_amplite_is_an_error(tmp_path):
    class Plain(AmpliteTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss  # not through super(): the FP32 model

    trainer = Plain(ex.tiny_gpt2(), _args(tmp_path), train_dataset=ex.TokenData(20, 0))
    with pytest.raises(AmpliteError, match="no batch went through amplite"):
        _train(trainer)
    with pytest.raises(AmpliteError, match="precision 'fp8'"):
        AmpliteTrainer(ex.tiny_gpt2(), _args(tmp_path), amplite_precision="fp8")
