"""The prepared net trains under DistributedDataParallel (gloo, 2 CPU processes)."""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, level: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import amplite
        from fixtures import train_zoo

        model, _ = train_zoo.make("cnn")
        torch.manual_seed(100 + rank)  # ranks start from different weights: DDP's broadcast must reach the graph
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = train_zoo.loader("cnn", 6, seed=rank)  # each rank sees its own data
        net, opt = amplite.prepare_training(model, optimizer, batches[0][0], precision="bf16", level=level)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        for x, y in batches[:3]:
            opt.backward(F.cross_entropy(ddp(x), y))
            opt.step()
            opt.zero_grad()
        torch.save({k: v for k, v in model.state_dict().items() if "running" not in k}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_gloo_two_processes_differently_seeded_end_identical(tmp_path, level):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), level), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    from fixtures import train_zoo

    fresh, _ = train_zoo.make("cnn")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # rank 0's weights broadcast, gradients averaged
    assert any(not torch.equal(a[k], fresh.state_dict()[k]) for k in a)  # and the masters moved
