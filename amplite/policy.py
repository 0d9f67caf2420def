"""The precision policy: levels, user overrides and their priority, as plain data.

Nothing here knows about torch.fx. The ``annotate_precision`` pass reads each graph node's facts (op name,
module path, node name, range flags, neighbours' modes) and asks :meth:`PrecisionPolicy.decide`.

Precedence is data owned by the policy: :data:`LAYERS` lists ``(RuleSource, rule)`` pairs in
:data:`PRIORITY` order (strongest first: DTYPE facts, pins, range, fidelity, structure, op table, level) and
:meth:`PrecisionPolicy.decide` returns the first layer's answer, so a weaker layer can never overwrite a
stronger one. The pass computes each node's :class:`NodeFacts`; the rules are plain functions of the policy
and those facts. docs/policy.md quotes this table (a test compares them).

Within the pin layer, a ``node:`` override beats ``module:``, which beats ``op:``, which beats an
unprefixed one; at the same rank keep-FP32 beats force-low: when a user's patterns disagree, stay safe.
Overrides do not apply at O0, which converts nothing.

Every :class:`Decision` names the layer that made it (:class:`RuleSource`), so that passes and the report
read who decided from a typed field, never from the display string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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

    def matches(self, op: str, module: str, node: str) -> bool:
        """Whether this rule applies to an op named ``op`` in ``module``, at node ``node``."""
        g = self.glob
        op_hit = fnmatchcase(op, g) or fnmatchcase(op.split(".")[0], g)
        mod_hit = bool(module) and (fnmatchcase(module, g) or (g.endswith(".*") and module == g[:-2]))
        node_hit = fnmatchcase(node, g)
        return {"op": op_hit, "module": mod_hit, "node": node_hit}.get(self.kind, op_hit or mod_hit or node_hit)


_RANK = {"node": 0, "module": 1, "op": 2, "any": 3}


@dataclass(frozen=True)
class NodeFacts:
    """What the policy needs to know about one node. The ``annotate_precision`` pass reads these off the
    graph; the policy alone decides from them.

    Attributes:
        op: ATen overload key (``softmax.int``), or another callable's name for non-ATen ops.
        module: Dotted module path the node came from ('' when unknown).
        node: The graph node's name.
        range_flag: ``range_guard``'s reason to keep the op FP32 (``range:activation …``), or ''.
        range_cleared: ``range_guard``'s reason an FP32-list op may follow its input
            (``range:small-integer-pow``), or ''.
        fp32_reader: Some reader of the value computes in FP32.
        discrete: The op makes a discrete decision (``topk``, ``argmax``…) or computes the values one reads.
        feeds_fp32: The op reaches an FP32 op directly or through one op.
        bridges_fp32: Every floating operand comes from an FP32 op and every reader is one.
        feeds_norm: A normalisation reads the value, directly or through views (a residual stream).
    """

    op: str
    module: str = ""
    node: str = ""
    range_flag: str = ""
    range_cleared: str = ""
    fp32_reader: bool = False
    discrete: bool = False
    feeds_fp32: bool = False
    bridges_fp32: bool = False
    feeds_norm: bool = False


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
    #: ``--precision fp8``'s activation scheme (``static`` or ``dynamic``); empty: no FP8.
    fp8: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", precision_dtype(self.precision))

    @property
    def low_dtype(self) -> torch.dtype:
        """The low-precision dtype."""
        return self.precision  # type: ignore[return-value]  # a dtype after __post_init__

    def decide(self, facts: NodeFacts | str, module: str = "", node: str = "") -> Decision:
        """Decide how one op computes: the first answer of :data:`LAYERS`, strongest layer first.

        Args:
            facts: What the pass read off the graph for this node, or just the op's table key
                (``softmax.int``) for a node with no graph facts.
            module: Dotted module path (only with an op key; '' when unknown).
            node: The graph node's name (only with an op key).
        """
        if isinstance(facts, str):
            facts = NodeFacts(facts, module, node)
        if self.level is Level.O0:  # the FP32 baseline: no layer applies, overrides included
            return Decision("fp32", "level:O0", RuleSource.LEVEL)
        for _, rule in LAYERS:
            decision = rule(self, facts)
            if decision is not None:
                return decision
        raise AssertionError("the level layer answers for every op")  # pragma: no cover

    @property
    def mixed(self) -> bool:
        """Whether the level mixes precisions (O1/O2): the graph-shaped rules apply only then."""
        return self.level in (Level.O1, Level.O2)

    def for_fp8(self, current: Decision, no_kernel: str, overflow: str) -> Decision:
        """Whether a matrix product the plan made low runs in FP8 (``--precision fp8``).

        A second decision, after :meth:`decide`: not which precision (the layers' question, answered first)
        but which low format, asked only of ops the layers made ``low``; it never changes a mode.

        Args:
            current: The decision so far.
            no_kernel: Why the op has no FP8 kernel here (``no-weight-operand``, ``no-fp8-kernel:conv2d``), or ''.
            overflow: The range fact that keeps it out of e4m3 (``fp8-range:overflow ...``, with the measured
                value), or ''.

        A pin (``--force-low``, the budget search's ``fp8-error`` pins) names its dtype: the op stays in the
        low dtype; FP32 decisions stay FP32. Otherwise the op runs in FP8, or stays low with the reason why not.
        """
        if not self.fp8 or current.mode != "low" or current.pinned:
            return current
        if no_kernel:
            return Decision("low", f"fp8-kept:{no_kernel}", RuleSource.OP_TABLE)
        if overflow:
            return Decision("low", overflow, RuleSource.RANGE)
        return Decision("low", f"fp8:{self.fp8}", RuleSource.LEVEL, fp8=True)

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
_NORMALISERS = frozenset(op_tables.NORMALISER_OPS)

Rule = Callable[[PrecisionPolicy, NodeFacts], "Decision | None"]


def _pins(policy: PrecisionPolicy, f: NodeFacts) -> Decision | None:
    """Explicit pins: the user's ``--keep-fp32``/``--force-low`` and amplite's own (training, checkpoint,
    budget), each decision carrying its rule's source."""
    hit = policy._override(f.op, policy.user_module(f.module), f.node)
    if hit is None:
        return None
    return Decision("fp32" if hit.action == "keep_fp32" else "low", hit.reason, hit.source)


def _range(policy: PrecisionPolicy, f: NodeFacts) -> Decision | None:
    """Calibrated ranges: a flagged op computes in FP32; an FP32-list op ``range_guard`` cleared (a small
    integer power) follows its input at O1/O2, unless a reader is FP32 (an RMSNorm's ``x.pow(2).mean()``)
    or its value feeds a discrete decision."""
    if f.range_flag:
        return Decision("fp32", f.range_flag, RuleSource.RANGE)
    if policy.mixed and f.range_cleared and not f.fp32_reader and not f.discrete and op_tables.fp32_reason(f.op):
        return Decision("follow", f.range_cleared, RuleSource.RANGE)
    return None


def _fidelity(policy: PrecisionPolicy, f: NodeFacts) -> Decision | None:
    """At O1/O2 a discrete decision and the producers of the values it reads compute as FP32 does, so the
    decision does not flip between runtimes on near-ties."""
    return Decision("fp32", DISCRETE_DECISION, RuleSource.FIDELITY) if policy.mixed and f.discrete else None


def _structure(policy: PrecisionPolicy, f: NodeFacts) -> Decision | None:
    """Island shape at O1/O2: an ``amax``-like normaliser (exact in any dtype) feeding an FP32 op stays FP32,
    so that op needs no cast; at O2 an op outside the FP32 list that only connects FP32 ops (the ``+ eps``
    between ``mean`` and ``rsqrt``) stays FP32: running it low costs two casts and a rounding; and at O2 an add
    a normalisation reads (``residual-stream``) stays FP32."""
    if policy.mixed and f.feeds_fp32 and f.op in _NORMALISERS:
        return Decision("fp32", "fp32-list:normaliser-feeds-fp32", RuleSource.STRUCTURE)
    if policy.level is not Level.O2 or op_tables.fp32_reason(f.op) is not None:
        return None
    if f.bridges_fp32:
        return Decision("fp32", "fp32-island-bridge", RuleSource.STRUCTURE)
    if f.feeds_norm and f.op in op_tables.RESIDUAL_STREAM_OPS:
        # the residual stream of a pre- or post-norm block: each block's small update would be lost in the
        # stream's rounding (EVA-02 tiny bf16 O2: 36.9 -> 47.6 dB)
        return Decision("fp32", RESIDUAL_STREAM, RuleSource.STRUCTURE)
    return None


def _op_table(policy: PrecisionPolicy, f: NodeFacts) -> Decision | None:
    """The FP32 list (reductions, softmax, norms, transcendental ops) and, at O1, the low list; O3 has none."""
    if policy.level is Level.O3:
        return None
    group = op_tables.fp32_reason(f.op)
    if group is not None:
        return Decision("fp32", f"fp32-list:{group}", RuleSource.OP_TABLE)
    if policy.level is Level.O1 and f.op in _LOW:
        return Decision("low", f"low-list:{f.op.split('.')[0]}", RuleSource.OP_TABLE)
    return None


def _level(policy: PrecisionPolicy, f: NodeFacts) -> Decision:
    """What the level makes of everything else: low at O2/O3, follow the inputs at O1."""
    if policy.level in (Level.O2, Level.O3):
        return Decision("low", f"level:{policy.level.value}", RuleSource.LEVEL)
    return Decision("follow", "follow-inputs", RuleSource.LEVEL)


#: The policy's layers, strongest first: :meth:`PrecisionPolicy.decide` takes the first answer, so a layer
#: can never overwrite a stronger one. The order is :data:`PRIORITY`'s (checked at import); the pin layer
#: speaks for every override source (user, budget, training, checkpoint: one rank). DTYPE facts come last,
#: from the pass: no dtype choice can change an FP64 value or an in-place destination.
LAYERS: tuple[tuple[RuleSource, Rule], ...] = (
    (RuleSource.USER, _pins),
    (RuleSource.RANGE, _range),
    (RuleSource.FIDELITY, _fidelity),
    (RuleSource.STRUCTURE, _structure),
    (RuleSource.OP_TABLE, _op_table),
    (RuleSource.LEVEL, _level),
)
assert [PRIORITY[s] for s, _ in LAYERS] == sorted({p for s, p in PRIORITY.items() if s is not RuleSource.DTYPE})


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
