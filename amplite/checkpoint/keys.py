"""Which shard tensors make each model tensor: transformers' own checkpoint-to-parameter mapping.

``from_pretrained`` renames checkpoint keys (``block_sparse_moe`` -> ``mlp``, ``LayerNorm.gamma`` ->
``.weight``, base-model prefixes) and converts some (transformers 5 fuses per-expert MoE weights into one
``experts.gate_up_proj``). :func:`map_keys` applies the same transforms (``get_model_conversion_mapping``,
``rename_source_key``) to the shard names, then checks the result against the meta model before anything
is written: every tensor's shape and dtype, every tensor the model needs (tied ones excepted), so a
wrong-sized head or a missing one is refused instead of "verified" against itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amplite.checkpoint.source import Checkpoint
from amplite.errors import LoadError


@dataclass
class Source:
    """How one model tensor is made from shard tensors.

    Attributes:
        target: The model's state-dict name (the first target of a converter).
        keys: ``(shard tensor name, source pattern)`` in transformers' load order.
        converter: transformers' ``WeightConverter`` (a template, copied per use), None for a plain tensor.
    """

    target: str
    keys: list[tuple[str, str]] = field(default_factory=list)
    converter: Any = None


@dataclass
class KeyMap:
    """Model tensor -> its source, plus the tensors transformers ties instead of loading.

    Attributes:
        sources: Model state-dict name -> :class:`Source` (a converter's other targets point to the same one).
        tied: Model name -> the model name whose values it shares (``lm_head.weight`` -> embeddings).
        unused: Shard tensors the model does not read (a tied twin stored anyway, stale keys).
        model: The meta model (transformers' converters may read its config).
        twins: Shard tensor -> the model tensor it is tied to (stored anyway, equal to it: stored alike).
    """

    sources: dict[str, Source]
    tied: dict[str, str]
    unused: list[str]
    model: nn.Module
    twins: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str:
        """The model name whose values ``name`` has (follows ties)."""
        seen = 0
        while name not in self.sources and name in self.tied and seen < 16:
            name, seen = self.tied[name], seen + 1
        return name

    def build(self, name: str, load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every model tensor ``name``'s source makes, from shard tensors read with ``load``."""
        src = self.sources[self.resolve(name)]
        if src.converter is None:
            return {src.target: load(src.keys[0][0])}
        conv = copy.deepcopy(src.converter)
        for key, pattern in src.keys:
            conv.add_tensor(src.target, key, pattern, (lambda k=key: load(k)))
        out = conv.convert(src.target, model=self.model, config=getattr(self.model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def shard_targets(self) -> dict[str, str]:
        """Shard tensor name -> the model tensor it feeds (for choosing its stored dtype)."""
        return {key: src.target for src in self.sources.values() for key, _ in src.keys}


def _transforms(lm: nn.Module) -> tuple[list[Any], list[Any], dict[str, Any]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(lm)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def map_keys(ckpt: Checkpoint, lm: nn.Module) -> KeyMap:
    """Map the shard tensors to ``lm``'s state dict as ``from_pretrained`` does, and check them.

    Args:
        ckpt: The checkpoint (tensor metadata only).
        lm: The transformers model, built on meta.

    Raises:
        LoadError: A tensor of the wrong shape or dtype (naming tensor, shard and both shapes), a model
            tensor no shard holds and the config does not tie, an unsupported conversion.
    """
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    expected = lm.state_dict(keep_vars=True)
    non_persistent = {n for n, _ in lm.named_non_persistent_buffers()} if hasattr(lm, "named_non_persistent_buffers") \
        else set()  # fmt: skip
    renamings, converters, by_pattern = _transforms(lm)
    prefix = getattr(lm, "base_model_prefix", None) or None
    sources: dict[str, Source] = {}
    unused: list[str] = []
    for key in sorted(ckpt.tensors, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if target not in expected and key in expected:
            target, pattern = rename_source_key(key, [], [], prefix, expected)
        if target not in expected:
            unused.append(key)
            continue
        src = sources.setdefault(target, Source(target, converter=by_pattern.get(pattern) if pattern else None))
        src.keys.append((key, pattern or key))
    tied = dict(getattr(lm, "all_tied_weights_keys", None) or {})
    for target, origin in list(tied.items()):  # from_pretrained ties symmetrically: the stored side is the source
        if target in sources and origin not in sources:
            tied[origin] = target
            del tied[target]
    twins: dict[str, str] = {}
    for target, origin in list(tied.items()):
        if target in sources and origin in sources and not _equal_twins(ckpt, sources[target], sources[origin]):
            del tied[target]  # both stored and different: transformers unties them and loads each
            _untie(lm, target)
            continue
        for key, _ in sources.pop(target, Source(target)).keys:  # a tied twin stored anyway: transformers ties
            twins[key] = origin  # over it (the values are equal), so it is not read
    kmap = KeyMap(sources, tied, unused, lm, twins)
    _check(ckpt, kmap, expected, non_persistent)
    return kmap


def _equal_twins(ckpt: Checkpoint, a: Source, b: Source) -> bool:
    """Whether two stored tensors of a tie hold the same values (transformers' ``tie_weights`` in
    ``from_pretrained`` ties them only then; a converted tensor is compared as a tie, never read here)."""
    from amplite.checkpoint.source import load_tensor

    if a.converter is not None or b.converter is not None or len(a.keys) != 1 or len(b.keys) != 1:
        return True
    x, y = (load_tensor(ckpt.tensors[s.keys[0][0]]) for s in (a, b))
    if x.shape != y.shape:
        return False
    wide = torch.promote_types(x.dtype, y.dtype)
    return torch.equal(x.to(wide), y.to(wide))


def _untie(lm: nn.Module, target: str) -> None:
    """Give ``target`` its own (meta) parameter, as ``from_pretrained`` leaves an untied pair."""
    owner, _, attr = target.rpartition(".")
    module = lm.get_submodule(owner)
    old = getattr(module, attr)
    setattr(module, attr, nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=old.requires_grad))
    keys = getattr(lm, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        keys.pop(target, None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(ckpt: Checkpoint, kmap: KeyMap, expected: dict[str, torch.Tensor], non_persistent: set[str]) -> None:
    cfg = ckpt.path / "config.json"
    buffers = {n for n, b in expected.items() if not isinstance(b, nn.Parameter)}
    for src in {id(s): s for s in kmap.sources.values()}.values():
        infos = [ckpt.tensors[k] for k, _ in src.keys]
        want = expected[src.target]
        if src.converter is None and len(infos) > 1:
            raise LoadError(f"{infos[0].name} ({infos[0].shard.name}) and {infos[1].name} ({infos[1].shard.name}) "
                            f"both load into {src.target}", "keep one of them in the shards")  # fmt: skip
        for info in infos:
            if info.dtype.is_floating_point != want.dtype.is_floating_point or (info.dtype == torch.bool) != (
                want.dtype == torch.bool
            ):
                raise LoadError(f"{info.name} in {info.shard.name} is {_dtype_name(info.dtype)}, the model's "
                                f"{src.target} is {_dtype_name(want.dtype)}",
                                "regenerate the shard (weights must keep their kind of dtype)")  # fmt: skip
        meta = {k: torch.empty(ckpt.tensors[k].shape, dtype=ckpt.tensors[k].dtype, device="meta") for k, _ in src.keys}
        try:
            built = kmap.build(src.target, meta.__getitem__)
        except Exception as exc:
            raise LoadError(f"transformers' conversion of {infos[0].name} ({infos[0].shard.name}) into "
                            f"{src.target} fails: {type(exc).__name__}: {exc}",
                            "check the shards' tensor shapes") from None  # fmt: skip
        for target, t in built.items():
            if target not in expected:
                raise LoadError(f"{infos[0].name} ({infos[0].shard.name}) converts to {target!r}, which the model "
                                "does not have", "check model_type and architectures in config.json")  # fmt: skip
            if tuple(t.shape) != tuple(expected[target].shape):
                where = ", ".join(sorted({f"{i.name} {tuple(i.shape)} in {i.shard.name}" for i in infos})[:3])
                raise LoadError(f"shape mismatch: {where} makes {target} {tuple(t.shape)}, but {cfg} gives the "
                                f"model {tuple(expected[target].shape)}", "the shards and config.json do not "
                                "belong together: regenerate one of them")  # fmt: skip
            kmap.sources.setdefault(target, src)
    for name, want in expected.items():
        tied = name in kmap.tied and kmap.resolve(name) in kmap.sources
        if name in non_persistent or tied or name in kmap.sources or name in buffers:
            continue  # a buffer the model computes is initialised as from_pretrained initialises it
        raise LoadError(f"the model {cfg} describes needs {name!r} {tuple(want.shape)}, which no shard holds (and "
                        "the config does not tie it)", "add the tensor to the shards, or fix the config "
                        "(tie_word_embeddings?)")  # fmt: skip
