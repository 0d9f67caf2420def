"""The decode path makes every tensor on the program's device (issue 41): checked on the CPU, structurally.

A factory call without ``device`` puts its tensor on the CPU; on a CUDA program that is either an error or a
host-to-device copy per token. Two checks need no GPU: a program on the ``meta`` device (every tensor it is
fed must be on ``meta``, and nothing is read back to the host), and a ``TorchFunctionMode`` that records every
factory call and every device move during prefill and decode.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")

from amplite.llm.generate import Runner, greedy, teacher_forced  # noqa: E402
from amplite.llm.step import LMStep, amplite_attention, program_device  # noqa: E402

VOCAB = 128
FACTORIES = {
    torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.randint, torch.rand,
    torch.randn, torch.eye, torch.linspace, torch.as_tensor, torch.scalar_tensor,
}  # fmt: skip


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg).eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


class Recorder(TorchFunctionMode):
    """Factory calls as ``(name, device passed or None)`` and amplite's device moves (``Tensor.to``/``cuda``/
    ``cpu`` called from amplite's code: transformers' own ``.to(lm_head.weight.device)``, a model-parallel hop
    that is a no-op on one device, is not the decode path's to remove)."""

    def __init__(self) -> None:
        super().__init__()
        self.factories: list[tuple[str, Any]] = []
        self.moves = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            self.factories.append((func.__name__, kwargs.get("device")))
        elif func in (torch.Tensor.cuda, torch.Tensor.cpu) or (func is torch.Tensor.to and _moves(args, kwargs)):
            self.moves += _called_from_amplite()
        return func(*args, **kwargs)


def _moves(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (or another tensor's)."""
    rest = list(args[1:]) + list(kwargs.values())
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in rest)


def _called_from_amplite() -> bool:
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    return frame is not None and "/amplite/" in frame.f_code.co_filename


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def test_program_device_is_read_from_the_program() -> None:
    model = _gpt2()
    assert program_device(LMStep(copy.deepcopy(model).to("meta"))) == torch.device("meta")
    assert Runner(LMStep(copy.deepcopy(model).to("meta")), LMStep(model).shape, torch.float32).device.type == "meta"


def test_a_program_on_another_device_is_fed_only_tensors_on_that_device() -> None:
    """A step on ``meta`` (a device that is not the CPU, and cannot be read back): greedy and teacher-forced
    decoding feed it nothing made on the CPU after the prompt moved once, and never sync to read a value."""
    meta = copy.deepcopy(_gpt2()).to("meta")
    step = LMStep(meta)
    seen: list[torch.device] = []
    step.register_forward_pre_hook(lambda _m, a: seen.extend(t.device for t in a))
    runner = Runner(step, step.shape, torch.float32)
    ids, mask = _prompts()
    with amplite_attention(meta):
        out = greedy(runner, ids, 4, mask)
        teacher_forced(runner, ids, mask, torch.zeros(2, 3, dtype=torch.long))
    assert out.device.type == "meta" and out.shape == (2, 9)
    assert len(seen) == 4 * (4 + 3) and {d.type for d in seen} == {"meta"}, seen  # 4 steps + 3 steps, 4 args each


@pytest.mark.parametrize("which", ["reference", "converted"])
def test_every_factory_call_names_the_program_device_and_nothing_moves_per_step(which: str) -> None:
    """Every factory call during prefill + decode (amplite's, transformers', the exported graph's) passes an
    explicit ``device`` equal to the program's; device moves happen at prefill only, not once per token."""
    model = _gpt2()
    if which == "reference":
        step = LMStep(model)
        runner = Runner(step, step.shape, torch.float32)
    else:
        from amplite.llm import convert_llm

        runner = convert_llm(model, precision="bf16", level="O2", verify=False).llm.runner()
    ids, mask = _prompts()
    counts = {}
    for n in (2, 6):
        rec = Recorder()
        with amplite_attention(model), rec:
            greedy(runner, ids, n, mask)
        missing = [(f, d) for f, d in rec.factories if d is None or torch.device(d) != runner.device]
        assert not missing, missing
        counts[n] = rec.moves
    assert counts[2] == counts[6] > 0, counts  # moves are per generation (the prompt), none per decode step


def test_runner_cache_grows_branches_and_takes_whole_cache_programs() -> None:
    """The step returns only its new tokens; the runner's cache (allocated for the prompt alone here, so
    decode must grow it) gives the tokens of a step that returns the whole grown cache (a ``.pt2`` saved
    before), and decoding twice from one cache (a branch) leaves the first result intact."""
    model = _gpt2()
    step = LMStep(model)
    ids, mask = _prompts()

    def whole_cache(i: torch.Tensor, m: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        logits, nk, nv = step(i, m, k, v)
        return logits, torch.cat([k, nk], dim=3), torch.cat([v, nv], dim=3)

    with amplite_attention(model), torch.no_grad():
        runner = Runner(step, step.shape, torch.float32)
        logits, keys, values = runner.prefill(ids, mask)  # capacity: the prompt's 5 tokens
        token, mask1 = logits[:, -1].argmax(-1), torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        assert step(token[:, None], mask1, keys, values)[1].shape[3] == 1  # new tokens only
        first = runner.decode(token, mask1, keys, values)
        kept = first[1].clone()
        again = runner.decode(token, mask1, keys, values)  # a branch from the same cache
        assert torch.equal(first[1], kept) and torch.equal(again[0], first[0]) and again[1].shape[3] == 6
        ours = greedy(runner, ids, 6, mask)
        old = Runner(whole_cache, step.shape, torch.float32, device=runner.device)
        assert torch.equal(greedy(old, ids, 6, mask), ours)
