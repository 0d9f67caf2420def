"""FSDP2 (fully_shard) under prepare_training, 2 gloo processes on the CPU: sharded FP32 masters, each layer
gathered inside its own call and cast by amplite's plan there, FP32 gradients reduce-scattered. The losses
equal one process training on the concatenated batch (O1 and O2); O2's low copies live only inside their
layer's gathered window; under fp16 an overflow on one rank's shard makes every rank skip and rescale; the
unsupported combinations are refused in one line naming the supported order."""

from __future__ import annotations

import gc
import os
import socket
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amplite
from amplite.errors import ConfigError
from tests.conftest import once_per_run, start_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")  # a torch built without distributed has no FSDP2

WORLD, B, STEPS = 2, 4, 4  # per-rank batch; the global batch is WORLD * B


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _Model(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, WORLD * B, 8, generator=g), torch.randint(0, 4, (STEPS, WORLD * B), generator=g)


def _shard(model: _Model, **kw) -> _Model:
    for block in model.blocks:
        fsdp.fully_shard(block, **kw)
    fsdp.fully_shard(model, **kw)
    return model


def _error(fn) -> str:
    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        xs, ys = _data()
        mine = slice(rank * B, (rank + 1) * B)
        model = _shard(_Model())
        shard_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        net, opt = amplite.prepare_training(model, optimizer, xs[0][mine], precision="bf16", level="O1")
        calls = []  # FSDP's hooks run around each block's part of the graph (they gather its shards)
        hooks = [b.register_forward_pre_hook(lambda m, a: calls.append(("in", type(m.fc1.weight).__name__)))
                 for b in model.blocks]  # fmt: skip
        hooks += [b.register_forward_hook(lambda m, a, o: calls.append(("out", type(m.fc1.weight).__name__)))
                  for b in model.blocks]  # fmt: skip
        losses = []
        for k in range(STEPS):
            with _Ops() as ops:
                loss = F.cross_entropy(net(xs[k][mine]), ys[k][mine])
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / WORLD)
        for h in hooks:
            h.remove()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        net.eval()
        with torch.no_grad():
            evaluated = net(xs[0])  # the eval graph, split per unit the same way
        o2, o2_ckpt = _o2_run(xs, ys, mine), _o2_run(xs, ys, mine, ckpt=True)
        fp16 = _fp16_run(xs, ys, mine, rank)
        errors = {
            "after": _error(lambda: _after_order(xs[0][mine])),
            "O3": _error(lambda: _prepare(_shard(_Model()), xs[0][mine], "O3")),
            "on_change": _error(lambda: _prepare(_shard(_Model()), xs[0][mine], "O2", recast="on_change")),
            "param_dtype": _error(lambda: _prepare(
                _shard(_Model(), mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)), xs[0][mine], "O1")),
        }  # fmt: skip
        torch.save({"losses": losses, "full": full, "eval": evaluated, "shards": shard_shapes, "ops": ops.seen,
                    "calls": calls, "errors": errors, "o2": o2, "o2_ckpt": o2_ckpt, "fp16": fp16},
                   f"{out}/rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


class _Ops(TorchDispatchMode):
    """The (op, input dtypes) pairs that run."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, tuple[str, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add((str(func.overloadpacket), tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _prepare(model: nn.Module, x: torch.Tensor, level: str, **kw) -> None:
    amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), x, level=level, **kw)


def _o2_run(xs: torch.Tensor, ys: torch.Tensor, mine: slice, ckpt: bool = False) -> dict:
    """O2 bf16 under FSDP2: the losses, the full parameters, how many low copies outlived each forward;
    with ``ckpt`` each block is checkpointed (``recast``: the casts made outside a forward window)."""
    model = _shard(_Model(ckpt))
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.2), xs[0][mine],
                                        precision="bf16", level="O2")  # fmt: skip
    made: list[weakref.ref] = []
    copies, recast, shapes = opt.copies, [], []
    low_of = copies.low_of
    copies.low_of = lambda m: _noted(low_of(m), made, shapes) if copies.open else _noted(low_of(m), recast)
    losses, alive = [], []
    for k in range(STEPS):
        with _Ops() as ops:
            loss = F.cross_entropy(net(xs[k][mine]), ys[k][mine])
            gc.collect()
            alive.append(sum(r() is not None for r in made))  # copies held between forward and backward
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "full": full, "alive": alive, "made": len(made), "ops": ops.seen,
            "tracked": sorted(shapes[: len(shapes) // STEPS]), "recast": len(recast),
            "regions": net.info["checkpointed_regions"]}


def _noted(low: torch.Tensor, made: list, shapes: list | None = None) -> torch.Tensor:
    made.append(weakref.ref(low.untyped_storage()))  # the storage: autograd saves views of the copy
    if shapes is not None:
        shapes.append(tuple(low.shape))
    return low


def _fp16_run(xs: torch.Tensor, ys: torch.Tensor, mine: slice, rank: int) -> dict:
    """fp16 O1 under FSDP2 with an inf planted in rank 0's shard of one gradient at step 1 only."""
    model = _shard(_Model())
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.2), xs[0][mine],
                                        precision="fp16", level="O1")  # fmt: skip
    taken = []
    for k in range(STEPS):
        opt.backward(F.cross_entropy(net(xs[k][mine]), ys[k][mine]))
        if k == 1 and rank == 0:
            model.blocks[0].fc1.weight.grad.to_local()[0, 0] = float("inf")  # this rank's shard only
        taken.append(opt.step())
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"history": list(opt.scaler.history), "scale": opt.loss_scale, "taken": taken, "full": full}


def _after_order(x: torch.Tensor) -> None:
    """prepare_training first, fully_shard afterwards: refused at the next forward."""
    model = _Model()
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), x, level="O1")
    _shard(model)
    net(x)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    def spawn(out: Path) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_ranks(_worker, (port, str(out)), WORLD)
        return str(out)

    # once per test run: under xdist a module fixture would spawn the two processes on each worker
    out = Path(once_per_run(tmp_path_factory, "fsdp2-ranks", spawn))
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _one_process(level: str) -> tuple[nn.Module, object, torch.Tensor, list[float]]:
    """The reference: one process trains the same model on the concatenated batches at ``level``; returns the
    model, the net, the first batch and the losses."""
    xs, ys = _data()
    model = _Model()
    net, opt = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.2), xs[0], level=level)
    ref = []
    for k in range(STEPS):
        loss = F.cross_entropy(net(xs[k]), ys[k])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    return model, net, xs[0], ref


def test_fsdp2_losses_equal_one_process_on_the_concatenated_batch(ranks):
    model, net, x0, ref = _one_process("O1")
    a, b = ranks
    assert a["losses"] == b["losses"]
    assert a["losses"][0] == pytest.approx(ref[0], rel=1e-6)  # the same weights, the same plan
    # later steps: each rank's bf16 weight gradient is rounded on its half of the batch before the FP32
    # reduce-scatter averages them (one process rounds the whole batch's): measured 3e-4 relative
    assert a["losses"] == pytest.approx(ref, rel=2e-3)
    for name, p in model.named_parameters():
        assert torch.equal(a["full"][name], b["full"][name])
        torch.testing.assert_close(a["full"][name], p.detach(), rtol=0, atol=2e-3)
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(a["eval"], net(x0), rtol=0.02, atol=0.02)  # bf16 logits, weights within 2e-3


def test_fsdp2_masters_are_sharded_gathered_per_block_and_the_plan_applies(ranks):
    a = ranks[0]
    assert a["shards"]["blocks.0.fc1.weight"] == (32, 16)  # FP32 masters: half of the 64 rows on each rank
    # each block's part ran inside the block's own call, once per step: FSDP's pre-forward hook had gathered the
    # full parameters when the part started, its post-forward hook put the shards back when it ended
    assert a["calls"] == [("in", "Parameter"), ("out", "DTensor")] * (2 * STEPS)
    ops = a["ops"]  # the last step's forward: matmuls in bf16, LayerNorm (an FP32 island) in FP32
    assert ("aten.addmm", ("torch.bfloat16",) * 3) in ops
    assert not any(op in ("aten.addmm", "aten.mm") and "torch.float32" in dt for op, dt in ops)
    assert any(op == "aten.native_layer_norm" and dt[0] == "torch.float32" for op, dt in ops)


def test_fsdp2_unsupported_combinations_name_the_supported_order(ranks):
    errors = ranks[0]["errors"]
    assert "fully_shard was applied after prepare_training" in errors["after"] and "apply it first" in errors["after"]
    assert "not O3" in errors["O3"] and "level='O2'" in errors["O3"]
    assert "recast='on_change'" in errors["on_change"] and "every_forward" in errors["on_change"]
    assert "gathers parameters in bfloat16" in errors["param_dtype"]


def test_fsdp2_o2_trains_as_one_process_with_copies_only_inside_the_gathered_window(ranks):
    model, _, _, ref = _one_process("O2")
    a, b = ranks[0]["o2"], ranks[1]["o2"]
    assert a["losses"] == b["losses"]
    assert a["losses"][0] == pytest.approx(ref[0], rel=1e-6)
    assert a["losses"] == pytest.approx(ref, rel=2e-3)  # bf16 gradients rounded per rank, as at O1
    for name, p in model.named_parameters():
        assert torch.equal(a["full"][name], b["full"][name])
        torch.testing.assert_close(a["full"][name], p.detach(), rtol=0, atol=2e-3)
    # every Linear weight and bias was cast inside its window at each forward, and none of those copies was
    # alive between forward and backward: autograd held the FP32 masters and backward recast them
    linears = sorted(s for m in model.modules() if isinstance(m, nn.Linear) for s in (tuple(m.weight.shape),
                                                                                      tuple(m.bias.shape)))
    assert a["tracked"] == linears
    assert a["made"] == len(linears) * STEPS
    assert a["alive"] == [0] * STEPS
    ops = a["ops"]  # forward and backward matmuls in bf16 (backward's weight read recast from the master)
    assert ("aten.addmm", ("torch.bfloat16",) * 3) in ops
    assert ("aten.mm", ("torch.bfloat16",) * 2) in ops
    assert not any(op in ("aten.addmm", "aten.mm") and "torch.float32" in dt for op, dt in ops)


def test_fsdp2_fp16_overflow_on_one_rank_skips_and_rescales_on_every_rank(ranks):
    a, b = ranks[0]["fp16"], ranks[1]["fp16"]
    # the inf was planted in rank 0's shard only: both ranks found it, skipped step 1 and halved the scale
    assert a["taken"] == b["taken"] == [True, False, True, True]
    assert a["history"] == b["history"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    assert a["scale"] == b["scale"] == 2.0**15
    for name in a["full"]:
        assert torch.equal(a["full"][name], b["full"][name])


def test_fsdp2_checkpointed_blocks_recompute_inside_their_backward_window(ranks):
    plain, ckpt = ranks[0]["o2"], ranks[0]["o2_ckpt"]
    assert ckpt["regions"] == 2
    # the recomputation runs the same ops in the same dtypes on the re-gathered weights: the same training
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, p in plain["full"].items():
        torch.testing.assert_close(ckpt["full"][name], p, rtol=0, atol=1e-6)
    # each block's fc1/fc2 weight and bias were cast again in backward by the recompute (from the parameters
    # FSDP gathered for that block's backward), outside any forward window, and nothing kept them
    assert ckpt["recast"] == 2 * 4 * STEPS
    assert ckpt["alive"] == [0] * STEPS
