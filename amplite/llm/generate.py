"""Greedy generation with a step program (prefill once, then one decode step per token, KV cache in and out).

Works on anything with the :class:`~amplite.llm.step.LMStep` signature: the converted program's module, a
loaded ``.pt2`` or the FP32 ``LMStep`` itself (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amplite.errors import ConfigError
from amplite.llm.step import CacheShape, program_device

Step = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Runner:
    """A step callable with its cache geometry and dtype, and the KV cache it fills.

    ``device`` is the program's (:func:`~amplite.llm.step.program_device`: its parameters'), never a default:
    the prompt moves there once at prefill and everything made afterwards is made there, so a decode step
    moves nothing between devices.

    The step returns only its new tokens' keys/values; the runner writes them into a cache it allocates at
    prefill for ``capacity`` tokens (doubled when a decode step needs more) and hands out views of its
    filled part, so a decode step copies the new tokens, not the cache. A program saved before this
    returned the whole cache: its output is passed through as it is.
    """

    step: Step
    shape: CacheShape
    cache_dtype: torch.dtype
    device: torch.device = field(default=None)  # type: ignore[assignment]  # None: the program's
    _cache: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _filled: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.device = program_device(self.step) if self.device is None else torch.device(self.device)

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits of every prompt position and the cache after the prompt (the prompt moved to the program);
        ``capacity``: the cache length to allocate for (at least the prompt's)."""
        empty = self.shape.empty(input_ids.shape[0], self.cache_dtype, self.device)
        with torch.no_grad():
            logits, keys, values = self.step(input_ids.to(self.device), attention_mask.to(self.device), empty, empty)
        self._cache = None
        return (logits, *self._append(empty, empty, keys, values, capacity))

    def decode(
        self, token: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One new token per row (``token`` ``[B]``); ``attention_mask`` covers the cache and the token."""
        with torch.no_grad():
            logits, new_keys, new_values = self.step(token[:, None], attention_mask, keys, values)
        return (logits, *self._append(keys, values, new_keys, new_values))

    def _append(
        self, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
        capacity: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The cache ``keys``/``values`` followed by the step's new tokens, as views of the runner's cache."""
        past, added = keys.shape[3], new_keys.shape[3]
        if past and added > past:  # decode adds 1 token: more is the whole cache (a program saved before)
            return new_keys, new_values
        length = past + added
        cache = self._cache
        # Written in place only when ``keys`` is the cache this runner last returned: an older view (a caller
        # decoding twice from one cache) gets a fresh cache rather than having its successor overwritten.
        own = cache is not None and past == self._filled and keys.data_ptr() == cache[0].data_ptr()
        if not own or length > cache[0].shape[3]:  # first call, a cache made elsewhere, or full: (re)allocate
            size = [*new_keys.shape[:3], max(capacity, length, 2 * past), new_keys.shape[4]]
            cache = tuple(torch.empty(size, dtype=self.cache_dtype, device=self.device) for _ in range(2))
            cache[0][:, :, :, :past].copy_(keys)
            cache[1][:, :, :, :past].copy_(values)
            self._cache = cache
        cache[0][:, :, :, past:length].copy_(new_keys)
        cache[1][:, :, :, past:length].copy_(new_values)
        self._filled = length
        return cache[0][:, :, :, :length], cache[1][:, :, :, :length]


def prepare(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` as ``[B, S]`` int64 and its mask (ones when not given); checks the padding is on the left.

    Raises:
        ConfigError: Wrong rank or dtype, a mask of another shape, right padding, or an empty prompt.
    """
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.shape[1] == 0:
        raise ConfigError(
            f"input_ids must be a non-empty [batch, length] integer tensor, got {list(input_ids.shape)} "
            f"{str(input_ids.dtype).removeprefix('torch.')}",
            "pass token ids, e.g. tokenizer(text, return_tensors='pt').input_ids",
        )
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    mask = mask[None] if mask.dim() == 1 else mask
    if mask.shape != ids.shape:
        raise ConfigError(f"attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}",
                          "give one mask entry per token (1 = token, 0 = padding)")  # fmt: skip
    mask = mask.long()
    if bool((mask[:, -1] == 0).any()):
        raise ConfigError(
            "the prompts are right-padded (a row's last token is masked)",
            "pad on the left (tokenizer.padding_side = 'left'), as for transformers' generate",
        )
    return ids.long(), mask


def greedy(
    runner: Runner,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy decoding: ``[B, S + n]`` ids on the program's device, prompt first, ``n <= max_new_tokens``
    (rows that produced ``eos_token_id`` continue with it until every row has; generation then stops).
    Without ``eos_token_id`` no step reads a value back to the host (no sync per token on a GPU).

    Raises:
        ConfigError: Bad ``input_ids``/``attention_mask`` (see :func:`prepare`) or ``max_new_tokens < 0``.
    """
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is negative", "ask for 0 or more new tokens")
    ids, mask = prepare(input_ids, attention_mask)
    ids, mask = ids.to(runner.device), mask.to(runner.device)  # once: every step's tensors derive from these
    if max_new_tokens == 0:
        return ids
    logits, keys, values = runner.prefill(ids, mask, ids.shape[1] + max_new_tokens)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=runner.device)
    out = [ids]
    for i in range(max_new_tokens):
        token = logits[:, -1].argmax(-1)
        if eos_token_id is not None:
            token = torch.where(done, torch.full_like(token, eos_token_id), token)
            done |= token == eos_token_id
        out.append(token[:, None])
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, keys, values = runner.decode(token, mask, keys, values)
    return torch.cat(out, dim=1)


def teacher_forced(
    runner: Runner, input_ids: torch.Tensor, attention_mask: torch.Tensor, forced: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token predictions when ``forced`` ``[B, M]`` is fed back instead of the model's own tokens.

    Returns:
        ``(predictions [B, M], logits [B, M, V])``: position ``t`` is the prediction after the prompt and
        ``forced[:, :t]``; prefill makes position 0, each decode step one more.
    """
    mask, forced = attention_mask.to(runner.device), forced.to(runner.device)  # once, not per step
    logits, keys, values = runner.prefill(input_ids, mask, input_ids.shape[1] + forced.shape[1])
    last = [logits[:, -1]]
    for t in range(forced.shape[1] - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_logits, keys, values = runner.decode(forced[:, t], mask, keys, values)
        last.append(step_logits[:, -1])
    stacked = torch.stack(last, dim=1)
    return stacked.argmax(-1), stacked
