"""Pass infrastructure, after torch.fx's and onnx-ir's pass managers.

A pass is an object with settings fixed in ``__init__`` and a ``__call__(gm) -> PassResult``. It may
rewrite the GraphModule in place; it keeps no state between calls. Every rewrite bumps a named counter in
the result, and the pipeline copies all counters into the report under the pass's ``name``. A result may
also carry ``details``, a JSON-able dict of per-node records (e.g. which candidates a fusion rejected and
why), which the report keeps beside the counters.

Every pass also states its contract as code, as onnx-ir's ``PassBase`` does: ``requires(gm)`` (what must
hold before it runs) and ``ensures(gm)`` (what holds after it ran), each returning None or raising a
:class:`PassContractError` that names the pass and the broken condition. :class:`PassManager` calls both
around every pass, always: they are part of the run, not a debug mode, so each is one walk of the graph.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import torch.fx

from amplite.errors import AmpliteError, InternalError
from amplite.passes.meta import CAST_KEY, OUT_DTYPE_KEY, PRECISION_KEY


class PassContractError(InternalError):
    """A pass's precondition or postcondition does not hold: a bug in amplite (exit 3), never the user's.

    Args:
        pass_name: The pass whose contract broke.
        condition: The condition that does not hold, with the node that breaks it.
        kind: ``precondition`` or ``postcondition``.

    Attributes:
        pass_name: As given.
        condition: As given.
        kind: As given.
    """

    kind = "contract"

    def __init__(self, pass_name: str, condition: str) -> None:
        self.pass_name = pass_name
        self.condition = condition
        super().__init__(f"amplite bug: {self.kind} of pass {pass_name} does not hold: {condition}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across batch workers like the other errors
        return (type(self), (self.pass_name, self.condition))


class PreconditionError(PassContractError):
    """``requires`` refused the graph the pass was given (an earlier pass, or the order, is wrong)."""

    kind = "precondition"


class PostconditionError(PassContractError):
    """``ensures`` found that the pass did not leave the graph as it promises."""

    kind = "postcondition"


@dataclass
class PassResult:
    """What one pass did.

    Attributes:
        graph_module: The (possibly rewritten) module.
        modified: Whether the graph changed.
        counters: Named counts of each kind of rewrite or decision.
    """

    graph_module: torch.fx.GraphModule
    modified: bool
    counters: Counter[str] = field(default_factory=Counter)


class Pass(Protocol):
    """A graph pass: settings in ``__init__``, work in ``__call__``, its contract in ``requires``/``ensures``."""

    name: str

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult: ...

    def requires(self, gm: torch.fx.GraphModule) -> None: ...

    def ensures(self, gm: torch.fx.GraphModule) -> None: ...


class PassBase(abc.ABC):
    """Base of amplite's passes: a name and a contract (override ``requires``/``ensures`` to state one).

    The defaults state nothing; a pass that overrides neither says so by inheriting them. A subclass without
    ``__call__`` cannot be instantiated (abstract).
    """

    name = ""

    @abc.abstractmethod
    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        """Run the pass on ``gm``."""

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Raise :class:`PreconditionError` unless ``gm`` is a graph this pass may run on."""
        return None  # the default states no condition

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Raise :class:`PostconditionError` unless this pass left ``gm`` as it promises."""
        return None  # the default states no condition

    def refuse_input(self, condition: str) -> PreconditionError:
        """The error for a broken precondition of this pass."""
        return PreconditionError(self.name, condition)

    def broken(self, condition: str) -> PostconditionError:
        """The error for a broken postcondition of this pass."""
        return PostconditionError(self.name, condition)

    def require_unplanned(self, gm: torch.fx.GraphModule) -> None:
        """Precondition of the passes before the plan: no node has a decision or an amplite cast yet (what
        they read or flag must be the FP32 graph the plan is made on)."""
        for node in gm.graph.nodes:
            if PRECISION_KEY in node.meta or CAST_KEY in node.meta:
                raise self.refuse_input(f"node {node.name} is already planned or cast: this pass runs before the plan")

    def require_planned(self, gm: torch.fx.GraphModule) -> None:
        """Precondition of the passes after the plan: every node but amplite's casts has its planned dtype."""
        for node in gm.graph.nodes:
            if node.op != "output" and OUT_DTYPE_KEY not in node.meta and CAST_KEY not in node.meta:
                raise self.refuse_input(f"node {node.name} has no planned dtype: annotate_precision must run first")


@dataclass
class PassRecord:
    """One pass's result as kept for the report."""

    name: str
    modified: bool
    counters: dict[str, int]
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


class PassManager:
    """Runs passes in order, each between its ``requires`` and ``ensures``, lints and keeps their records.

    Args:
        passes: The passes to run, in order (each with ``requires``/``ensures``: :class:`PassBase`).
        lint: Run ``graph.lint()`` after each pass that modified the graph (catches broken rewrites
            where they happen rather than at re-export).
        name: The sequence's name (in :meth:`describe` and in its postcondition's error).
        postcondition: A check (a pass that does not rewrite) run after the last pass: the sequence's
            ``ensures``. Its record follows the passes'; an :class:`InternalError` it raises becomes the
            sequence's :class:`PostconditionError`.

    Raises:
        TypeError: A pass declares no ``requires``/``ensures``.
    """

    def __init__(
        self, passes: Sequence[Pass], lint: bool = True, *, name: str = "passes", postcondition: Pass | None = None
    ) -> None:
        self.passes = list(passes)
        self.lint = lint
        self.name = name
        self.postcondition = postcondition
        for p in [*self.passes, *([postcondition] if postcondition is not None else [])]:
            if not (callable(getattr(p, "requires", None)) and callable(getattr(p, "ensures", None))):
                raise TypeError(f"pass {getattr(p, 'name', p)!r} declares no requires/ensures: derive it from PassBase")

    def names(self) -> list[str]:
        """The passes' names, in the order they run (the postcondition last)."""
        return [p.name for p in self.passes] + ([self.postcondition.name] if self.postcondition is not None else [])

    def describe(self) -> str:
        """The sequence as one line: ``name: a → b → c; ensures check``."""
        text = f"{self.name}: " + " → ".join(p.name for p in self.passes)
        return text + (f"; ensures {self.postcondition.name}" if self.postcondition is not None else "")

    def __call__(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[PassRecord]]:
        """Run every pass on ``gm``; return the final module and one record per pass."""
        records: list[PassRecord] = []
        modified = False
        for p in self.passes:
            start = perf_counter()
            _guarded(p, "requires", gm)
            result = _guarded(p, "__call__", gm)
            gm = result.graph_module
            if result.modified:
                modified = True
                if self.lint:
                    gm.graph.lint()
            _guarded(p, "ensures", gm)
            details = dict(getattr(result, "details", None) or {})
            records.append(PassRecord(p.name, result.modified, dict(result.counters), perf_counter() - start, details))
        if modified:  # passes work on the graph; its Python code is regenerated once, for whoever runs it next
            gm.recompile()
        if self.postcondition is not None:
            start = perf_counter()
            try:
                check = _guarded(self.postcondition, "__call__", gm)
            except PassContractError:
                raise
            except InternalError as exc:  # the check's own finding: the sequence broke its postcondition
                raise PostconditionError(self.name, exc.problem.removeprefix("amplite bug: ")) from exc.__cause__
            records.append(PassRecord(self.postcondition.name, False, dict(check.counters), perf_counter() - start))
        return gm, records


def _guarded(p: Pass, method: str, gm: torch.fx.GraphModule) -> Any:
    """``p.method(gm)``, with a crash (not a user or contract error) reported as amplite's bug in that pass."""
    try:
        return getattr(p, method)(gm)
    except AmpliteError:
        raise
    except Exception as exc:  # a pass that crashes is amplite's bug, whatever the model
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        what = "" if method == "__call__" else f" ({method})"
        raise InternalError(f"amplite bug: pass {p.name}{what} failed: {type(exc).__name__}: {first}") from exc


def call_function_nodes(gm: torch.fx.GraphModule) -> Iterable[torch.fx.Node]:
    """The graph's ``call_function`` nodes, in order (a snapshot, safe to edit while iterating)."""
    return [n for n in gm.graph.nodes if n.op == "call_function"]
