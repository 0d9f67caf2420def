"""The prepared net trains under DistributedDataParallel (gloo, 2 CPU processes)."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.conftest import once_per_run, start_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, levels: tuple[str, ...]) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import amplite
        from fixtures import train_zoo

        for level in levels:  # one process pair for every level: a fresh model, optimizer and DDP wrapper each
            model, _ = train_zoo.make("cnn")
            torch.manual_seed(100 + rank)  # ranks start from different weights: DDP's broadcast must reach the graph
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            batches = train_zoo.loader("cnn", 3, seed=rank)  # each rank sees its own data
            net, opt = amplite.prepare_training(model, optimizer, batches[0][0], precision="bf16", level=level)
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            for x, y in batches:
                opt.backward(F.cross_entropy(ddp(x), y))
                opt.step()
                opt.zero_grad()
            state = {k: v for k, v in model.state_dict().items() if "running" not in k}
            torch.save(state, f"{out}/{level}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


LEVELS = ("O1", "O2")


@pytest.fixture(scope="module")
def ddp_out(tmp_path_factory: pytest.TempPathFactory):
    """Two gloo processes train every level in turn (one process start-up for all levels)."""
    def spawn(out: Path) -> str:
        start_ranks(_worker, (2, _free_port(), str(out), LEVELS))
        return str(out)

    # once per test run: under xdist a module fixture would spawn the two processes on each worker
    return Path(once_per_run(tmp_path_factory, "ddp-levels", spawn))


@pytest.mark.parametrize("level", LEVELS)
def test_ddp_gloo_two_processes_differently_seeded_end_identical(ddp_out, level):
    a, b = (torch.load(ddp_out / f"{level}-rank{r}.pt") for r in (0, 1))
    from fixtures import train_zoo

    fresh, _ = train_zoo.make("cnn")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # rank 0's weights broadcast, gradients averaged
    assert any(not torch.equal(a[k], fresh.state_dict()[k]) for k in a)  # and the masters moved
