"""The integrations under DDP with 2 gloo processes on the CPU, launched as torchrun would (RANK, LOCAL_RANK,
WORLD_SIZE in the environment): Lightning's ``strategy="ddp"`` with ``AmplitePrecision`` and transformers'
``AmpliteTrainer`` (Accelerate's multi-process DDP). Ranks start from different weights; they must end with
identical weights, and the losses and weights must equal one process training on the same global batches.
Lightning's FSDP1 strategy is refused naming the supported alternatives (FSDP2: tests/test_integration_fsdp.py)."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")  # optional extras: amplite[lightning], amplite[transformers]
transformers = pytest.importorskip("transformers")

import amplite  # noqa: E402
from amplite.errors import ConfigError  # noqa: E402
from amplite.integrations.lightning import AmplitePrecision  # noqa: E402
from amplite.integrations.transformers import AmpliteTrainer  # noqa: E402
from tests.conftest import once_per_run, start_ranks  # noqa: E402

B, STEPS, WORLD = 4, 6, 2  # per-rank batch, optimizer steps; the global batch is WORLD * B
HF_B, HF_STEPS, SEQ, VOCAB = 2, 4, 16, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------------- Lightning
class _Lit(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # each rank its own initial weights: DDP's broadcast must reach the graph
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _lit_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(WORLD * B * STEPS, 16, generator=g),
                                          torch.randint(0, 4, (WORLD * B * STEPS,), generator=g))  # fmt: skip


def _lit_fit(rank: int, devices: int, strategy: str) -> _Lit:
    model = _Lit(seed=rank)
    # each rank its part of every global batch (slice r of samples k*WORLD*B ... (k+1)*WORLD*B - 1)
    mine = [k * WORLD * B + rank * B + j for k in range(STEPS) for j in range(B)]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(_lit_data(), mine), batch_size=B)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, plugins=[AmplitePrecision("bf16", level="O2")])  # fmt: skip
    trainer.fit(model, loader)
    return model


# ---------------------------------------------------------------------------------------- transformers
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_fit(rank: int, out: str, batch: int, distributed: bool = True) -> AmpliteTrainer:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(rank)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=HF_STEPS, per_device_train_batch_size=batch, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, bf16=True, use_cpu=True, seed=0, report_to=[],
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo" if distributed else None,
    )  # fmt: skip
    trainer = AmpliteTrainer(model, args, train_dataset=_Tokens(WORLD * HF_B * HF_STEPS), amplite_level="O2")
    trainer.train()
    return trainer


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    # what torchrun sets: Lightning and Accelerate then join this process group instead of launching their own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    try:
        lit = _lit_fit(rank, WORLD, "ddp")
        hf = _hf_fit(rank, f"{out}/hf", HF_B)
        losses = [e["loss"] for e in hf.state.log_history if "loss" in e]
        torch.save({"lit": (lit.state_dict(), lit.losses), "hf": (hf.model.state_dict(), losses)},
                   f"{out}/rank{rank}.pt")  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    """Two gloo processes run both integrations (one process start-up for the module)."""
    def spawn(out: Path) -> str:
        start_ranks(_worker, (_free_port(), str(out)), WORLD)
        return str(out)

    # once per test run: under xdist a module fixture would spawn the two processes on each worker
    out = Path(once_per_run(tmp_path_factory, "ddp-integrations", spawn))
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lightning_ddp_matches_one_process_on_the_global_batches(ranks):
    (sd0, losses0), (sd1, losses1) = ranks[0]["lit"], ranks[1]["lit"]
    _assert_same_weights(sd0, sd1)  # rank 0's weights broadcast, gradients averaged
    # one process, the same initial weights (rank 0's seed), the global batches in order, plain prepare_training
    ref = _Lit(seed=0)
    data = _lit_data()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    x0 = data.tensors[0][: WORLD * B]
    net, amp = amplite.prepare_training(ref.net, opt, x0, precision="bf16", level="O2")
    ref_losses = []
    for k in range(STEPS):
        x, y = (t[k * WORLD * B : (k + 1) * WORLD * B] for t in data.tensors)
        loss = F.cross_entropy(net(x), y)
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        ref_losses.append(loss.item())
    ddp_losses = [(a + b) / 2 for a, b in zip(losses0, losses1, strict=True)]  # equal local batches: the mean
    assert len(ddp_losses) == STEPS
    torch.testing.assert_close(torch.tensor(ddp_losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd0[k], v, rtol=0, atol=2e-3)


def test_trainer_ddp_matches_one_process_on_the_global_batches(ranks, tmp_path):
    (sd0, losses0), (sd1, _) = ranks[0]["hf"], ranks[1]["hf"]  # the logged loss: the mean over the ranks
    _assert_same_weights(sd0, sd1)
    warnings.filterwarnings("ignore")
    ref = _hf_fit(0, str(tmp_path), WORLD * HF_B, distributed=False)  # one process, the global batch size
    ref_losses = [e["loss"] for e in ref.state.log_history if "loss" in e]
    assert len(losses0) == len(ref_losses) == HF_STEPS
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(sd0[k], v, rtol=0, atol=2e-3)


def test_lightning_fsdp1_strategy_is_refused_naming_model_parallel_and_ddp():
    from lightning.pytorch.strategies import FSDPStrategy

    from amplite.integrations.lightning import _refuse_sharded

    # Lightning builds FSDP only on GPUs; the plugin's check reads the trainer's strategy
    trainer = type("T", (), {"strategy": FSDPStrategy()})()
    with pytest.raises(ConfigError, match=r"FSDPStrategy.*FSDP1.*ModelParallelStrategy.*strategy='ddp'"):
        _refuse_sharded(trainer)
