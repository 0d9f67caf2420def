"""A checkpoint whose forward does not trace on the meta device: its safetensors output without a program.

Some models cannot be exported from a meta build: a tensor made from Python data becomes a constant without
values (GPT-Neo, GraniteMoE), or rotary code branches on data (dynamic-NTK rope). The safetensors output needs
no trace: every floating weight is stored in the low dtype at O2 (in its source dtype at O1; the modules the
fp16 weight rules flag stay FP32), never wider than the source, exactly as the traced path stores a plan
that keeps no weight FP32. What cannot be produced is the ``.pt2`` (there is no program) and the block-wise
check (there is no graph to walk): the written directory is verified **through** ``from_pretrained`` instead,
the FP32 source and the output each loaded in turn (one model in memory at a time), on the same inputs.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from amplite.checkpoint.keys import KeyMap
from amplite.checkpoint.source import PREFIX, Checkpoint, LogitsOnly
from amplite.errors import ConfigError
from amplite.policy import Level
from amplite.verify.compare import Tolerance, compare

#: What the report says was verified, and how.
MODE = "through from_pretrained (no trace on meta: the FP32 source and the output loaded in turn, logits compared)"


def planned_dtypes(keys: KeyMap, low: torch.dtype, level: Level, flagged: dict[str, str]) -> dict[str, torch.dtype]:
    """Program-style name (``lm.`` + model tensor) -> dtype, without a plan: low at O2 (FP32 at O1 and for the
    modules the fp16 weight rules flag)."""
    expected = keys.model.state_dict(keep_vars=True)
    out: dict[str, torch.dtype] = {}
    for name in {*keys.sources, *keys.tied}:
        t = expected.get(name)
        if t is None or not t.dtype.is_floating_point:
            continue
        wide = level != Level.O2 or PREFIX + name.rsplit(".", 1)[0] in flagged
        out[PREFIX + name] = torch.float32 if wide else low
    return out


def real_inputs(example: Any, vocab: int) -> tuple[tuple, dict[str, Any]]:
    """Seeded inputs shaped like the (meta) example: token ids below ``vocab``, masks of ones."""
    gen = torch.Generator().manual_seed(0)

    def fake(name: str, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if "mask" in name:
            return torch.ones(t.shape, dtype=t.dtype)
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=gen).to(t.dtype)
        return torch.randint(0, max(vocab, 1), t.shape, generator=gen, dtype=t.dtype)

    args, kwargs = example
    return tuple(fake(f"arg{i}", a) for i, a in enumerate(args)), {k: fake(k, v) for k, v in kwargs.items()}


def _logits(cls: type, path: Path, dtype: Any, inputs: tuple[tuple, dict[str, Any]]) -> torch.Tensor:
    from amplite.checkpoint.model import quiet_transformers

    with quiet_transformers():
        model = cls.from_pretrained(path, dtype=dtype).eval()
    args, kwargs = inputs
    with torch.no_grad():
        out = LogitsOnly(model)(*args, **kwargs).detach().float()
    del model
    gc.collect()  # one model in memory at a time
    return out


def _stored(path: Path) -> list[torch.Tensor]:
    """One stored tensor per shard of a written directory (enough to read the low dtype it holds)."""
    from amplite.checkpoint.source import iter_shard, open_checkpoint

    out = []
    for shard in open_checkpoint(path).shards:
        for _, t in iter_shard(shard):
            if t.dtype.is_floating_point:
                out.append(t)
                break
    return out


def verify_through_loader(ckpt: Checkpoint, keys: KeyMap, converted: Path, inputs: tuple[tuple, dict[str, Any]],
                          tolerance: Tolerance) -> dict[str, Any]:  # fmt: skip
    """The ``verification`` section: the written directory as ``from_pretrained(dtype="auto")`` loads it, against
    the source loaded in FP32, on ``inputs``."""
    cls = type(keys.model)
    reference = _logits(cls, ckpt.path, torch.float32, inputs)
    try:
        got = _logits(cls, converted, "auto", inputs)
    except Exception as exc:  # transformers' own forward at the low dtype, or amplite's output?
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        low = next((t.dtype for t in _stored(converted) if t.dtype.itemsize == 2), torch.bfloat16)
        try:
            _logits(cls, ckpt.path, low, inputs)  # the naive cast of the source, as transformers loads it
        except Exception:
            raise ConfigError(f"transformers' {cls.__name__} does not run in {str(low)[6:]} (from_pretrained(OUT) and "
                              f"from_pretrained(SRC, dtype={str(low)[6:]}) both fail: {problem})",
                              "use the other --precision, or keep this model FP32") from None  # fmt: skip
        raise
    metrics = compare(reference, got, tolerance)
    return {
        "passed": all(m.passed for m in metrics),
        "inputs": "the example inputs",
        "tolerance": {**vars(tolerance), "criteria": list(tolerance.criteria)},
        "outputs": [m.to_dict() for m in metrics],
        "blocks": [],
        "mode": MODE,
    }
