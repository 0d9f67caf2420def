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

Every :class:`Decision` names the layer that made it (:class:`RuleSource`) and that layer's priority
(:data:`PRIORITY`), so that passes and the report read who decided from a typed field, never from the
display string. The graph-shaped rules (range flags, discrete decisions, normalisers that feed FP32 ops,
small integer powers, FP32-island bridges) live here too, as methods taking the facts the pass read off
the graph: the pass walks the graph, the policy decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from fnmatch import fnmatchcase
from typing import Literal

import torch

from amplite import op_tables
from amplite.errors import ConfigError
from amplite.levels import Level, precision_dtype

#: Reason of the fidelity rule for values that feed discrete decisions (topk, argmax, sort, ...).
DISCRETE_DECISION = "discrete-decision"

#: Reason of the structure rule for the adds of a residual stream at O2 (``op_tables.RESIDUAL_STREAM_OPS``).
RESIDUAL_STREAM = "residual-stream"

Mode = Literal["low", "fp32", "follow"]


class RuleSource(str, Enum):
    """The layer of the policy a decision comes from (the report's ``rule`` field)."""

    USER = "user"  # --keep-fp32 / --force-low
    BUDGET = "budget"  # the accuracy-budget search's node: pins
    TRAINING = "training"  # prepare_training's pins (batch-norm statistics)
    CHECKPOINT = "checkpoint"  # the checkpoint path's weight-range pins
    RANGE = "range"  # calibrated ranges (range_guard's flags)
    FIDELITY = "fidelity"  # discrete decisions computed as the FP32 model computes them
    STRUCTURE = "structure"  # island shape: normalisers feeding FP32, FP32-island bridges, small powers
    OP_TABLE = "op-table"  # the FP32 and low-precision lists (amplite.op_tables)
    LEVEL = "level"  # what the level makes of everything else (O0, O2, O3, follow at O1)
    DTYPE = "dtype"  # facts no rule can change: FP64 kept, in-place destinations, no float operand

    @property
    def is_override(self) -> bool:
        """Whether this source writes explicit pins (a user's or amplite's own), which beat every rule."""
        return self in _OVERRIDE_SOURCES


_OVERRIDE_SOURCES = frozenset({RuleSource.USER, RuleSource.BUDGET, RuleSource.TRAINING, RuleSource.CHECKPOINT})

#: Priority of each layer, strongest first (lower wins). DTYPE facts are not rules: the pass applies them
#: last because no dtype choice can change them (an FP64 value, an in-place destination).
PRIORITY: dict[RuleSource, int] = {
    RuleSource.DTYPE: 0,
    RuleSource.USER: 1,
    RuleSource.BUDGET: 1,
    RuleSource.TRAINING: 1,
    RuleSource.CHECKPOINT: 1,
    RuleSource.RANGE: 2,
    RuleSource.FIDELITY: 3,
    RuleSource.STRUCTURE: 4,
    RuleSource.OP_TABLE: 5,
    RuleSource.LEVEL: 6,
}


@dataclass(frozen=True)
class Decision:
    """How one op computes, why, and which layer of the policy decided.

    Attributes:
        mode: ``low`` (operands cast to the target dtype), ``fp32`` (operands cast to FP32) or
            ``follow`` (no cast: computes in its inputs' dtype, mixed inputs promoted to the widest).
        reason: Short, stable reason string for people, e.g. ``fp32-list:softmax`` or
            ``user:keep module:enc.*``. Code reads :attr:`source`, never this.
        source: The layer that made the decision.
    """

    mode: Mode
    reason: str
    source: RuleSource = RuleSource.LEVEL

    @property
    def priority(self) -> int:
        """The deciding layer's priority (lower wins, :data:`PRIORITY`)."""
        return PRIORITY[self.source]

    @property
    def pinned(self) -> bool:
        """Whether an explicit pin (user's or amplite's own) made this decision: graph rules leave it."""
        return self.source.is_override


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
    #: Who wrote the rule: the user (``--keep-fp32``/``--force-low``), or the part of amplite that pins it
    #: (training, checkpoint, budget). Only a user's rule must match a node (a typo is refused). A string
    #: (``"budget"``) is accepted and stored as the :class:`RuleSource`.
    source: RuleSource = RuleSource.USER
    #: What the report says instead of ``keep PATTERN`` (``isolated-error`` for the budget search's pins).
    why: str = ""

    def __post_init__(self) -> None:
        try:
            source = RuleSource(self.source)
        except ValueError:
            source = None
        if source is None or not source.is_override:
            writers = ", ".join(s.value for s in RuleSource if s.is_override)
            raise ConfigError(f"an override cannot come from {self.source!r}", f"use one of: {writers}")
        object.__setattr__(self, "source", source)

    @property
    def reason(self) -> str:
        """The report's reason for what this rule decides: ``user:keep op:softmax``, ``budget:isolated-error``."""
        verb = "keep" if self.action == "keep_fp32" else "low"
        return f"{self.source.value}:{self.why or f'{verb} {self.pattern}'}"

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
        precision: The low dtype, ``torch.float16`` or ``torch.bfloat16`` (``"fp16"``/``"bf16"`` are accepted
            and stored as the dtype).
        level: The optimisation level.
        overrides: User rules, applied in the documented priority.
        low_precision_io: Let graph inputs and outputs take the low dtype instead of keeping theirs.
    """

    precision: torch.dtype | str = torch.float16
    level: Level = Level.O1
    overrides: tuple[Override, ...] = field(default_factory=tuple)
    low_precision_io: bool = False
    #: Stripped from module paths before patterns see them: a wrapper amplite adds around the user's model
    #: (the checkpoint path's ``lm.``) is not part of the names the user writes.
    module_prefix: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", precision_dtype(self.precision))

    @property
    def low_dtype(self) -> torch.dtype:
        """The low-precision dtype."""
        return self.precision  # type: ignore[return-value]  # a dtype after __post_init__

    def decide(self, op: str, module: str = "", node: str = "") -> Decision:
        """Decide how ``op`` (a table key such as ``softmax.int``) computes.

        Args:
            op: ATen overload key, or another callable's name for non-ATen ops.
            module: Dotted module path the node came from ('' when unknown).
            node: The graph node's name.
        """
        if self.level is Level.O0:
            return Decision("fp32", "level:O0", RuleSource.LEVEL)
        hit = self._override(op, self.user_module(module), node)
        if hit is not None:
            return Decision("fp32" if hit.action == "keep_fp32" else "low", hit.reason, hit.source)
        if self.level is Level.O3:
            return Decision("low", "level:O3", RuleSource.LEVEL)
        group = op_tables.fp32_reason(op)
        if group is not None:
            return Decision("fp32", f"fp32-list:{group}", RuleSource.OP_TABLE)
        if self.level is Level.O2:
            return Decision("low", "level:O2", RuleSource.LEVEL)
        if op in _LOW:
            return Decision("low", f"low-list:{op.split('.')[0]}", RuleSource.OP_TABLE)
        return Decision("follow", "follow-inputs", RuleSource.LEVEL)

    @property
    def _mixed(self) -> bool:
        """Whether the level mixes precisions (O1/O2): the graph-shaped rules apply only then."""
        return self.level in (Level.O1, Level.O2)

    def for_range(self, current: Decision, flag: str) -> Decision:
        """An op ``range_guard`` flagged (``flag``, e.g. ``range:activation``) computes in FP32 unless a pin
        decided it or it already does."""
        if not flag or current.pinned or current.mode == "fp32":
            return current
        return Decision("fp32", flag, RuleSource.RANGE)

    def for_discrete_decision(self, current: Decision) -> Decision:
        """The decision for an op that makes, or computes the values of, a discrete decision.

        At O1/O2 it computes in FP32 (reason ``discrete-decision``) so the decision is the FP32 model's
        and does not flip between runtimes on near-ties; a pin (``--force-low``), O0/O3 and an op already
        in FP32 (``fp32-list:softmax``) keep ``current``.
        """
        if not self._mixed or current.pinned or current.mode == "fp32":
            return current
        return Decision("fp32", DISCRETE_DECISION, RuleSource.FIDELITY)

    def for_small_pow(self, current: Decision, cleared: str, any_reader_fp32: bool) -> Decision:
        """A ``pow`` that ``range_guard`` cleared (``cleared``: ``range:small-integer-pow``) leaves the FP32
        list and follows its input (O1/O2), unless a reader is FP32 (an RMSNorm's ``x.pow(2).mean()``)."""
        if not self._mixed or not cleared or any_reader_fp32 or current.source is not RuleSource.OP_TABLE:
            return current
        return Decision("follow", cleared, RuleSource.RANGE) if current.mode == "fp32" else current

    def for_normaliser(self, current: Decision, feeds_fp32: bool) -> Decision:
        """An ``amax``-like op (exact in any dtype) that feeds an FP32 op directly or through one op stays
        FP32 (O1/O2), so that op gets FP32 operands without another cast; pins win."""
        if not self._mixed or not feeds_fp32 or current.pinned:
            return current
        return Decision("fp32", "fp32-list:normaliser-feeds-fp32", RuleSource.STRUCTURE)

    def for_bridge(self, current: Decision, bridges_fp32: bool) -> Decision:
        """At O2 an op the level made low whose every float operand and every user is FP32 (the ``+ eps``
        between ``mean`` and ``rsqrt``) stays FP32: running it low costs two casts and a rounding."""
        if self.level is not Level.O2 or not bridges_fp32 or current.source is not RuleSource.LEVEL:
            return current
        return Decision("fp32", "fp32-island-bridge", RuleSource.STRUCTURE) if current.mode == "low" else current

    def for_residual_stream(self, current: Decision, op: str, feeds_norm: bool) -> Decision:
        """At O2 an add the level made low whose result a normalisation reads (the residual stream of a
        pre- or post-norm block) stays FP32: each block's small update would be lost in the stream's rounding."""
        if self.level is not Level.O2 or not feeds_norm or current.source is not RuleSource.LEVEL:
            return current
        if current.mode != "low" or op not in op_tables.RESIDUAL_STREAM_OPS:
            return current
        return Decision("fp32", RESIDUAL_STREAM, RuleSource.STRUCTURE)

    @staticmethod
    def is_discrete_decision(op: str) -> bool:
        """Whether ``op`` (a table key) turns values into indices or an order (``topk``, ``argmax``, ...)."""
        return op in _DISCRETE

    def unmatched(self, sites: Iterable[tuple[str, str, str]]) -> list[Override]:
        """The user's overrides that match none of ``sites`` (``(op, module, node)`` of every node a pass decides)."""
        left = [o for o in self.overrides if o.source is RuleSource.USER]
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


def make_overrides(
    keep_fp32: Iterable[str | Override] = (),
    force_low: Iterable[str | Override] = (),
    source: RuleSource | str = RuleSource.USER,
) -> tuple[Override, ...]:
    """Build override rules from the ``--keep-fp32`` / ``--force-low`` pattern lists.

    Args:
        keep_fp32: Patterns to keep in FP32, or ready :class:`Override` rules (kept as they are, with their
            own source: the budget search hands its pins over this way).
        force_low: Patterns to force low, likewise.
        source: Who wrote the plain patterns.
    """

    def one(action: Literal["keep_fp32", "force_low"], item: str | Override) -> Override:
        if isinstance(item, Override):
            if item.action != action:
                raise ConfigError(f"rule {item.pattern!r} is a {item.action} rule", "pass it in its own list")
            return item
        return Override(action, item, source)

    rules = [one("keep_fp32", p) for p in keep_fp32]
    rules += [one("force_low", p) for p in force_low]
    for rule in rules:
        if not rule.glob:
            raise ConfigError(f"empty override pattern {rule.pattern!r}", "write e.g. module:encoder.*")
    return tuple(rules)
