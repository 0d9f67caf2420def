"""How the documented loader, transformers' ``from_pretrained``, loads a written safetensors directory.

Verification reads a written directory the way it will be loaded (:func:`loader_dtypes`), and an output the
loader would break is refused before it is written (:func:`check_loadable`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from amplite.checkpoint.keys import KeyMap
from amplite.checkpoint.source import PREFIX, Checkpoint
from amplite.errors import ConfigError
from amplite.report.sections import WeightRule


def loader_dtypes(lm: Any, config: Mapping[str, Any]) -> Callable[[str], torch.dtype | None]:
    """Model tensor name -> the dtype ``from_pretrained(DIR)`` gives it (None: the stored one).

    transformers builds the model in the dtype ``config.json`` names and casts every stored floating tensor to
    its parameter's dtype, except the modules the model class keeps in FP32 (``_keep_in_fp32_modules`` at
    fp16, ``_keep_in_fp32_modules_strict`` at fp16 and bf16: its ``_get_dtype_plan``). A wider tensor stored in
    a float16 directory is therefore loaded as float16, whatever amplite's plan said.
    """
    name = config.get("dtype", config.get("torch_dtype"))
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return lambda n: None
    get_plan = getattr(lm, "_get_dtype_plan", None)
    plan = dict(get_plan(dtype)) if callable(get_plan) else {}
    params = {n for n, _ in lm.named_parameters(remove_duplicate=False)} if hasattr(lm, "named_parameters") else set()
    keep = [re.compile(rf"(^|\.){re.escape(k)}(\.|$)") for k, v in plan.items() if v == torch.float32]

    def of(n: str) -> torch.dtype | None:
        if params and n not in params:
            return None  # a buffer the model computes, not a stored parameter
        return torch.float32 if any(k.search(n) for k in keep) else dtype

    return of


def check_loadable(ckpt: Checkpoint, keys: KeyMap, dtypes: dict[str, torch.dtype],
                   weight_rules: Iterable[WeightRule]) -> None:  # fmt: skip
    """Refuse a safetensors output that ``from_pretrained`` would load broken (before anything is written).

    The output's ``config.json`` names one dtype and transformers casts every stored tensor to it (bar the
    modules the class keeps FP32): a weight kept wide because fp16 cannot hold it (``range:weight-overflow``)
    would load as ``inf``.

    Raises:
        ConfigError: Such a weight, naming it and the outputs that keep it.
    """
    from amplite.checkpoint.write import output_config

    over = {str(r.module).removeprefix(PREFIX): r.reason for r in weight_rules if "overflow" in (r.reason or "")}
    if not over:
        return
    entries = [(n, dtypes.get(n, i.dtype), tuple(i.shape)) for n, i in ckpt.tensors.items()]
    loaded = loader_dtypes(keys.model, output_config(ckpt, entries))
    for shard_name, target in keys.shard_targets().items():
        module = target.rsplit(".", 1)[0]
        want = loaded(target)
        if module in over and want is not None and want.itemsize < dtypes[shard_name].itemsize:
            raise ConfigError(f"{shard_name} ({over[module].removeprefix('range:weight-overflow ')}) is beyond "
                              f"float16's range: from_pretrained would load it as {str(want)[6:]} (inf) from a "
                              "safetensors output, whose config.json names one dtype",
                              "use --precision bf16, or write only the .pt2 (--format pt2: FP32 in it)")  # fmt: skip
