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

import torch

from amplite import op_tables
from amplite.decisions import (
    BROADCAST_GATE,
    DISCRETE_DECISION,
    PRIORITY,
    RESIDUAL_STREAM,
    Decision,
    Mode,
    Override,
    RuleSource,
    make_overrides,
)
from amplite.levels import Level, precision_dtype, resolve_level


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
        broadcast_gate: A ``mul`` reads the value and broadcasts it over a larger tensor (a squeeze-excitation
            gate).
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
    broadcast_gate: bool = False


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
        # the rules compare levels by identity (``policy.level is Level.O2``): a level written as text is one too
        object.__setattr__(self, "level", self.level if isinstance(self.level, Level) else resolve_level(self.level))

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
        return min(hits, key=lambda o: o.rank)


__all__ = [
    "BROADCAST_GATE",
    "DISCRETE_DECISION",
    "LAYERS",
    "PRIORITY",
    "RESIDUAL_STREAM",
    "Decision",
    "Level",
    "Mode",
    "NodeFacts",
    "Override",
    "PrecisionPolicy",
    "RuleSource",
    "make_overrides",
]

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
    between ``mean`` and ``rsqrt``) stays FP32: running it low costs two casts and a rounding; an add a
    normalisation reads (``residual-stream``) stays FP32; and at O1 a gate a ``mul`` broadcasts over a larger
    tensor (``broadcast-gate``) computes in FP32."""
    if policy.mixed and f.feeds_fp32 and f.op in _NORMALISERS:
        return Decision("fp32", "fp32-list:normaliser-feeds-fp32", RuleSource.STRUCTURE)
    if not policy.mixed or op_tables.fp32_reason(f.op) is not None:
        return None
    if policy.level is Level.O2 and f.bridges_fp32:
        return Decision("fp32", "fp32-island-bridge", RuleSource.STRUCTURE)
    if f.feeds_norm and f.op in op_tables.RESIDUAL_STREAM_OPS:
        # the residual stream of a pre- or post-norm block: each block's small update would be lost in the
        # stream's rounding (EVA-02 tiny bf16 O2: 36.9 -> 47.6 dB; O1 where a low projection restarts the
        # stream, MViT's stage transitions: mvit_v2_s bf16 O1 38.2 -> 40.4 dB)
        return Decision("fp32", RESIDUAL_STREAM, RuleSource.STRUCTURE)
    if policy.level is Level.O1 and f.broadcast_gate and f.op in op_tables.GATE_OPS:
        # one rounding shared by a whole channel (squeeze-excitation): repvit_m1 bf16 O1 35.6 -> 37.2 dB
        return Decision("fp32", BROADCAST_GATE, RuleSource.STRUCTURE)
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
