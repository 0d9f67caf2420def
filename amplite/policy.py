"""The precision policy: levels, user overrides and their priority, as plain data.

Nothing here knows about torch.fx. The ``annotate_precision`` pass turns each graph node into three
strings (op name, module path, node name) and asks :meth:`PrecisionPolicy.decide`.

Priority, highest first (documented in README and docs/policy.md):

1. A ``node:`` override (exact node name or glob).
2. A ``module:`` override (glob on the dotted module path from export's module stack; a pattern
   ``encoder.*`` also matches the module ``encoder`` itself).
3. An ``op:`` override (glob on the ATen op, e.g. ``softmax`` or ``softmax.int``).
4. An unprefixed override, matched against op, module path and node name.
5. Fidelity rules: the ``discrete-decision`` rule (O1/O2) keeps a ``topk``/``argmax``/``sort``… and the
   producers of the values it reads in FP32 (:meth:`PrecisionPolicy.for_discrete_decision`).
6. The level's rules and the op tables (:mod:`amplite.op_tables`).

Within one rank, keep-FP32 beats force-low: when a user's patterns disagree, stay safe.
Overrides do not apply at O0, which converts nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from fnmatch import fnmatchcase
from typing import Literal

import torch

from amplite import op_tables
from amplite.errors import ConfigError

LEVEL_ENV = "AMPLITE_LEVEL"
#: Reason of the fidelity rule for values that feed discrete decisions (topk, argmax, sort, ...).
DISCRETE_DECISION = "discrete-decision"


class Level(str, Enum):
    """Optimisation levels, after apex amp's names."""

    O0 = "O0"  # no conversion: the FP32 baseline
    O1 = "O1"  # compute-bound ops low, FP32 list FP32, the rest follows its inputs; weights stay FP32
    O2 = "O2"  # everything low except the FP32 list; weights used only in low precision stored low
    O3 = "O3"  # everything low (speed baseline)


PRECISIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

Mode = Literal["low", "fp32", "follow"]


@dataclass(frozen=True)
class Decision:
    """How one op computes and why.

    Attributes:
        mode: ``low`` (operands cast to the target dtype), ``fp32`` (operands cast to FP32) or
            ``follow`` (no cast: computes in its inputs' dtype, mixed inputs promoted to the widest).
        reason: Short, stable reason string, e.g. ``fp32-list:softmax`` or ``user:keep module:enc.*``.
    """

    mode: Mode
    reason: str


@dataclass(frozen=True)
class Override:
    """One user rule: keep FP32 or force low precision for what a pattern matches.

    Attributes:
        action: ``keep_fp32`` or ``force_low``.
        pattern: The pattern as the user wrote it; ``op:``, ``module:`` or ``node:`` prefixes pick
            what it matches; without a prefix it matches any of the three.
    """

    action: Literal["keep_fp32", "force_low"]
    pattern: str
    #: Who wrote the rule: ``user`` (``--keep-fp32``/``--force-low``), or the part of amplite that pins it
    #: (``training``, ``checkpoint``, ``budget``). Only a user's rule must match a node (a typo is refused).
    source: str = "user"

    @property
    def kind(self) -> str:
        """``op``, ``module``, ``node`` or ``any``."""
        prefix, sep, _ = self.pattern.partition(":")
        return prefix if sep and prefix in ("op", "module", "node") else "any"

    @property
    def glob(self) -> str:
        """The pattern without its prefix."""
        return self.pattern.split(":", 1)[1] if self.kind != "any" else self.pattern

    def matches(self, op: str, module: str, node: str) -> bool:
        """Whether this rule applies to an op named ``op`` in ``module``, at node ``node``."""
        g = self.glob
        op_hit = fnmatchcase(op, g) or fnmatchcase(op.split(".")[0], g)
        mod_hit = bool(module) and (fnmatchcase(module, g) or (g.endswith(".*") and module == g[:-2]))
        node_hit = fnmatchcase(node, g)
        return {"op": op_hit, "module": mod_hit, "node": node_hit}.get(self.kind, op_hit or mod_hit or node_hit)


_RANK = {"node": 0, "module": 1, "op": 2, "any": 3}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each op computes in.

    Attributes:
        precision: ``fp16`` or ``bf16``.
        level: The optimisation level.
        overrides: User rules, applied in the documented priority.
        low_precision_io: Let graph inputs and outputs take the low dtype instead of keeping theirs.
    """

    precision: str = "fp16"
    level: Level = Level.O1
    overrides: tuple[Override, ...] = field(default_factory=tuple)
    low_precision_io: bool = False
    #: Stripped from module paths before patterns see them: a wrapper amplite adds around the user's model
    #: (the checkpoint path's ``lm.``) is not part of the names the user writes.
    module_prefix: str = ""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}", f"use one of: {', '.join(PRECISIONS)}")

    @property
    def low_dtype(self) -> torch.dtype:
        """The low-precision dtype."""
        return PRECISIONS[self.precision]

    def decide(self, op: str, module: str = "", node: str = "") -> Decision:
        """Decide how ``op`` (a table key such as ``softmax.int``) computes.

        Args:
            op: ATen overload key, or another callable's name for non-ATen ops.
            module: Dotted module path the node came from ('' when unknown).
            node: The graph node's name.
        """
        if self.level is Level.O0:
            return Decision("fp32", "level:O0")
        hit = self._override(op, self.user_module(module), node)
        if hit is not None:
            verb = "keep" if hit.action == "keep_fp32" else "low"
            return Decision("fp32" if hit.action == "keep_fp32" else "low", f"user:{verb} {hit.pattern}")
        if self.level is Level.O3:
            return Decision("low", "level:O3")
        group = op_tables.fp32_reason(op)
        if group is not None:
            return Decision("fp32", f"fp32-list:{group}")
        if self.level is Level.O2:
            return Decision("low", "level:O2")
        if op in _LOW:
            return Decision("low", f"low-list:{op.split('.')[0]}")
        return Decision("follow", "follow-inputs")

    def for_discrete_decision(self, current: Decision) -> Decision:
        """The decision for an op that makes, or computes the values of, a discrete decision.

        At O1/O2 it computes in FP32 (reason ``discrete-decision``) so the decision is the FP32 model's
        and does not flip between runtimes on near-ties; a user override (``force_low``), O0/O3 and an
        op already in FP32 (``fp32-list:softmax``) keep ``current``.
        """
        if self.level not in (Level.O1, Level.O2) or current.reason.startswith("user:") or current.mode == "fp32":
            return current
        return Decision("fp32", DISCRETE_DECISION)

    @staticmethod
    def is_discrete_decision(op: str) -> bool:
        """Whether ``op`` (a table key) turns values into indices or an order (``topk``, ``argmax``, ...)."""
        return op in _DISCRETE

    def unmatched(self, sites: Iterable[tuple[str, str, str]]) -> list[Override]:
        """The user's overrides that match none of ``sites`` (``(op, module, node)`` of every node a pass decides)."""
        left = [o for o in self.overrides if o.source == "user"]
        for op, module, node in sites:
            if not left:
                break
            left = [o for o in left if not o.matches(op, self.user_module(module), node)]
        return left

    def user_module(self, module: str) -> str:
        """``module`` as the user names it (without :attr:`module_prefix`)."""
        if self.module_prefix and (module + ".").startswith(self.module_prefix):
            return module[len(self.module_prefix) :]
        return module

    def _override(self, op: str, module: str, node: str) -> Override | None:
        hits = [o for o in self.overrides if o.matches(op, module, node)]
        if not hits:
            return None
        return min(hits, key=lambda o: (_RANK[o.kind], o.action != "keep_fp32"))


_LOW = frozenset(op_tables.LOW_PRECISION_OPS)
_DISCRETE = frozenset(op_tables.DISCRETE_DECISION_OPS)


def resolve_level(level: str | Level | None) -> Level:
    """Resolve the level: explicit argument > ``AMPLITE_LEVEL`` > O1.

    Raises:
        ConfigError: If the level (from either source) is not O0-O3.
    """
    source = "--level"
    if level is None:
        level = os.environ.get(LEVEL_ENV) or None
        source = LEVEL_ENV
    if level is None:
        return Level.O1
    if isinstance(level, Level):
        return level
    text = str(level).strip().upper()
    if text in ("0", "1", "2", "3"):
        text = "O" + text
    try:
        return Level(text)
    except ValueError:
        raise ConfigError(f"unknown level {level!r} (from {source})", "use one of O0, O1, O2, O3") from None


def make_overrides(
    keep_fp32: tuple[str, ...] | list[str] = (), force_low: tuple[str, ...] | list[str] = (), source: str = "user"
) -> tuple[Override, ...]:
    """Build override rules from the ``--keep-fp32`` / ``--force-low`` pattern lists (``source``: who wrote them)."""
    rules = [Override("keep_fp32", p, source) for p in keep_fp32]
    rules += [Override("force_low", p, source) for p in force_low]
    for rule in rules:
        if not rule.glob:
            raise ConfigError(f"empty override pattern {rule.pattern!r}", "write e.g. module:encoder.*")
    return tuple(rules)
