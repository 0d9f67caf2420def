"""The ``node.meta`` keys amplite's passes write and read: each declared here, once, with its type.

Passes talk to later passes (and to ``converter/pipeline.collect_plan``) only through these keys; a test
(``tests/test_policy_sources.py``) refuses an ``"amplite_*"`` meta key written as a literal anywhere else.

* ``PRECISION_KEY`` (annotate_precision): a :class:`PrecisionAnnotation`, how the node computes.
* ``OUT_DTYPE_KEY`` (annotate_precision): the dtype (or a pytree of dtypes) the node produces.
* ``RANGE_KEY`` (range_guard, guard_constants): a range rule's reason (``range:...``): keep it FP32.
* ``RANGE_LOW_KEY`` (range_guard): a reason the node may stay low although it looks risky.
* ``SATURATE_KEY`` (guard_constants): ``[(operand, kind)]`` fills to saturate (popped when done).
* ``CAST_KEY`` (graph_utils.make_cast): ``True`` on every cast amplite inserted.
* ``CONTRACT_KEY`` (fuse_contractions): ``{"rule", "absorbed"}`` of a fused ``amplite::contract``.
* ``FP8_KEY`` (annotate_precision): a :class:`Fp8Site` on a matrix product the plan runs in FP8.
"""

from __future__ import annotations

from typing import TypedDict

import torch

PRECISION_KEY = "amplite_precision"
OUT_DTYPE_KEY = "amplite_out_dtype"
RANGE_KEY = "amplite_range"
RANGE_LOW_KEY = "amplite_range_low"
SATURATE_KEY = "amplite_saturate"
CAST_KEY = "amplite_cast"
CONTRACT_KEY = "amplite_contract"
FP8_KEY = "amplite_fp8"

#: Every declared key.
KEYS = (PRECISION_KEY, OUT_DTYPE_KEY, RANGE_KEY, RANGE_LOW_KEY, SATURATE_KEY, CAST_KEY, CONTRACT_KEY, FP8_KEY)


class PrecisionAnnotation(TypedDict):
    """``node.meta[PRECISION_KEY]``: the policy's decision for one node, as the passes after it read it.

    Attributes:
        mode: ``low``, ``fp32`` or ``follow``.
        dtype: The dtype its float operands will have (None when it has none).
        reason: The display reason (``fp32-list:softmax``, ``user:keep module:head.*``, ...).
        rule: The :class:`~amplite.policy.RuleSource` value that decided (``user``, ``range``, ...).
    """

    mode: str
    dtype: torch.dtype | None
    reason: str
    rule: str


class Fp8Site(TypedDict):
    """``node.meta[FP8_KEY]``: what ``fp8_linear`` needs to rewrite one matrix product.

    Attributes:
        x: Argument position of the activation.
        w: Argument position of the weight (a ``get_attr``, maybe behind casts).
        layout: ``nk`` (``[out, in]``, ``linear``) or ``kn`` (``[in, out]``, ``x @ W``).
        amax: The calibrated |activation| the static scale maps onto 448 (None: dynamic per token).
        w_amax: Per output channel, the amax each weight scale maps onto 448, chosen on the calibration
            data (None: each channel's own maximum).
    """

    x: int
    w: int
    layout: str
    amax: float | None
    w_amax: torch.Tensor | None
