"""The policy's vocabulary: who decides (:class:`RuleSource` and its :data:`PRIORITY`), what a decision is
(:class:`Decision`) and the pins users and amplite write (:class:`Override`, :func:`make_overrides`).

Kept apart from :mod:`amplite.policy`, which holds the rules and applies them in priority order, and
re-exported by it. Nothing here knows about torch.fx or graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase
from typing import Literal

from amplite.errors import ConfigError

#: Reason of the fidelity rule for values that feed discrete decisions (topk, argmax, sort, ...).
DISCRETE_DECISION = "discrete-decision"

#: Reason of the structure rule for the adds of a residual stream at O1/O2 (``op_tables.RESIDUAL_STREAM_OPS``).
RESIDUAL_STREAM = "residual-stream"

#: Reason of the structure rule for a gate broadcast over a feature map at O1 (``op_tables.GATE_OPS``).
BROADCAST_GATE = "broadcast-gate"

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
    #: A ``low`` decision whose matrix product runs in ``float8_e4m3fn`` (``--precision fp8``).
    fp8: bool = False

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

    @property
    def rank(self) -> tuple[int, bool]:
        """Sort key among rules that match one node (lowest wins): ``node:`` > ``module:`` > ``op:`` > any;
        at the same rank keep-FP32 beats force-low."""
        return _RANK[self.kind], self.action != "keep_fp32"

    def matches(self, op: str, module: str, node: str) -> bool:
        """Whether this rule applies to an op named ``op`` in ``module``, at node ``node``."""
        g = self.glob
        op_hit = fnmatchcase(op, g) or fnmatchcase(op.split(".")[0], g)
        mod_hit = bool(module) and (fnmatchcase(module, g) or (g.endswith(".*") and module == g[:-2]))
        node_hit = fnmatchcase(node, g)
        return {"op": op_hit, "module": mod_hit, "node": node_hit}.get(self.kind, op_hit or mod_hit or node_hit)


_RANK = {"node": 0, "module": 1, "op": 2, "any": 3}


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
