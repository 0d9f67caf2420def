"""Keyword inputs that reach ``forward(**kwargs)``, spelled out for ``torch.export``.

transformers' models take their loss keywords through ``**kwargs`` (``num_items_in_batch``, which the
``Trainer`` passes to normalise the loss by the token count of the whole accumulated batch). torch.export
(2.13) cannot pair ``dynamic_shapes`` with inputs under a ``**kwargs`` parameter ("Must provide a tree_name
when there might be a mismatch"), so while tracing, the model's ``forward`` is an instance attribute with
the same behaviour and a signature that names those keywords as keyword-only parameters. The graph then
takes them as ordinary inputs (a tensor ``num_items_in_batch`` is read at every call, not baked in).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn


@contextlib.contextmanager
def spelled_out(model: nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """While inside, ``model.forward``'s signature names every key of ``kwargs`` (nothing changes when
    ``forward`` has no ``**kwargs`` or every key is already a parameter)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        yield
        return
    params = list(sig.parameters.values())
    var_kw = next((p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = [k for k in kwargs if k not in sig.parameters]
    if var_kw is None or not extra or "forward" in model.__dict__:
        yield
        return
    named = [p for p in params if p is not var_kw]
    named += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in extra]
    named.append(var_kw)
    real = type(model).forward

    def forward(*args: Any, **kw: Any) -> Any:
        return real(model, *args, **kw)

    forward.__signature__ = sig.replace(parameters=named)  # type: ignore[attr-defined]
    model.forward = forward
    try:
        yield
    finally:
        model.__dict__.pop("forward", None)


__all__ = ["spelled_out"]
