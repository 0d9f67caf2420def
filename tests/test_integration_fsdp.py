"""FSDP2 through Lightning, 2 gloo processes on the CPU launched as torchrun would: ``ModelParallelStrategy``
(``configure_model`` applies ``fully_shard`` on the data-parallel mesh) with ``AmplitePrecision``. The ranks end
with identical full weights and train as one process on the global batches. (Lightning's FSDP1
``strategy="fsdp"`` is refused naming this route: tests/test_integration_ddp.py.)"""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")  # optional extra: amplite[lightning]
fsdp = pytest.importorskip("torch.distributed.fsdp")  # a torch built without distributed has no FSDP2

import amplite  # noqa: E402
from amplite.integrations.lightning import AmplitePrecision  # noqa: E402
from tests.conftest import start_ranks  # noqa: E402

B, STEPS, WORLD = 4, 4, 2  # per-rank batch, optimizer steps; the global batch is WORLD * B


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blocks, self.head = nn.Linear(8, 16), nn.ModuleList(_Block() for _ in range(2)), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Net()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fsdp.fully_shard(block, mesh=mesh)
        fsdp.fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(WORLD * B * STEPS, 8, generator=g),
                                          torch.randint(0, 4, (WORLD * B * STEPS,), generator=g))  # fmt: skip


def _fit(rank: int, precision: str) -> tuple[_Lit, AmplitePrecision]:
    model = _Lit()
    # each rank its part of every global batch (slice r of samples k*WORLD*B ... (k+1)*WORLD*B - 1)
    mine = [k * WORLD * B + rank * B + j for k in range(STEPS) for j in range(B)]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(_data(), mine), batch_size=B)
    plugin = AmplitePrecision(precision, level="O2", module="net")
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, plugins=[plugin])  # fmt: skip
    trainer.fit(model, loader)
    return model, plugin


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    # what torchrun sets: Lightning then joins this process group instead of launching its own processes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    try:
        lit, plugin = _fit(rank, "bf16")
        full = {n: p.full_tensor() for n, p in lit.net.named_parameters()}
        sharded = type(lit.net.blocks[0].fc1.weight).__name__
        info = {k: plugin.net.info[k] for k in ("fsdp_units", "level")}
        torch.save({"losses": lit.losses, "full": full, "sharded": sharded, "info": info}, f"{out}/rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("lightning_fsdp")
    start_ranks(_worker, (_free_port(), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_lightning_model_parallel_fsdp2_matches_one_process_on_the_global_batches(ranks):
    a, b = ranks
    assert a["sharded"] == "DTensor" and a["info"]["fsdp_units"] == 3 and a["info"]["level"] == "O2"
    for name in a["full"]:
        assert torch.equal(a["full"][name], b["full"][name])
    ref = _Net()
    data = _data()
    net, opt = amplite.prepare_training(ref, torch.optim.SGD(ref.parameters(), lr=0.2), data.tensors[0][: WORLD * B],
                                        precision="bf16", level="O2")  # fmt: skip
    ref_losses = []
    for k in range(STEPS):
        x, y = (t[k * WORLD * B : (k + 1) * WORLD * B] for t in data.tensors)
        loss = F.cross_entropy(net(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    fsdp_losses = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"], strict=True)]  # equal local batches
    assert len(fsdp_losses) == STEPS
    torch.testing.assert_close(torch.tensor(fsdp_losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(a["full"][name], p.detach(), rtol=0, atol=2e-3)

