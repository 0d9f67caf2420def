"""The converted step program (:class:`LLMProgram`), the conversion's result (:class:`LLMResult`), and
saving/loading the ``.pt2``.

The ``.pt2`` is the step program alone, written by ``torch.export.save``: anything that loads an
ExportedProgram loads it, and the cache geometry and dtype are read back from its input signature, so no
side file is needed. ``load`` reads it without unpickling (``amplite.reading.pt2.load_program``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.export import ExportedProgram

from amplite.converter import emit
from amplite.errors import InputSpecError
from amplite.llm.generate import Runner, greedy
from amplite.llm.step import CacheShape
from amplite.reading.pt2 import load_program
from amplite.report.sections import Outputs

if TYPE_CHECKING:
    from amplite.llm.metrics import LLMMetrics
    from amplite.report.document import Report
    from amplite.result import ConversionResult

_INPUTS = ("input_ids", "attention_mask", "past_keys", "past_values")


@dataclass
class LLMProgram:
    """A step program (``amplite.llm.step`` signature) with its cache geometry and dtype."""

    program: ExportedProgram
    shape: CacheShape
    cache_dtype: torch.dtype
    _module: Any = field(default=None, repr=False)
    _unchecked: Any = field(default=None, repr=False)

    @classmethod
    def from_program(cls, program: ExportedProgram) -> LLMProgram:
        """Read the cache geometry and dtype from the program's inputs.

        Raises:
            InputSpecError: The program does not take ``(input_ids, attention_mask, past_keys, past_values)``.
        """
        user = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
        past = vals.get(user[2]) if len(user) == 4 else None
        if tuple(user) != _INPUTS or not isinstance(past, torch.Tensor) or past.dim() != 5:
            raise InputSpecError(
                f"the program takes ({', '.join(user)}), not an amplite LLM step program's ({', '.join(_INPUTS)})",
                "convert the model with amplite.llm.convert_llm (or `amplite convert DIR --llm`)",
            )
        layers, _, heads, _, dim = past.shape
        return cls(program, CacheShape(int(layers), int(heads), int(dim)), past.dtype)

    def module(self) -> Any:
        """The program as a callable module (built once)."""
        if self._module is None:
            self._module = self.program.module()
        return self._module

    def runner(self) -> Runner:
        """The step callable with its cache geometry, for :mod:`amplite.llm.generate`.

        Its module skips torch's per-call input check (``validate_inputs``: a pytree flatten and every range
        constraint in Python, ≈0.1 ms per call, i.e. per generated token): the runner only feeds inputs it
        checked (``generate.prepare``) and the cache the program itself returned. :meth:`module` keeps it.
        """
        if self._unchecked is None:
            self._unchecked = self.program.module()
            if hasattr(self._unchecked, "validate_inputs"):  # torch 2.11+: the pre-forward check's switch
                self._unchecked.validate_inputs = False
        return Runner(self._unchecked, self.shape, self.cache_dtype)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy generation (:func:`amplite.llm.generate.greedy`): ``[B, S + n]`` token ids."""
        return greedy(self.runner(), input_ids, max_new_tokens, attention_mask, eos_token_id)

    def save(self, path: str | Path, conversion: dict[str, Any] | None = None) -> Path:
        """Write the program as a ``.pt2`` (atomically); ``conversion``: the record of how it was made
        (:func:`amplite.converter.emit.conversion_record`)."""
        return emit.save_program(self.program, path, conversion)


@dataclass
class LLMResult:
    """What :func:`amplite.llm.convert_llm` returns.

    Attributes:
        llm: The converted step program.
        conversion: ``amplite.convert``'s result for the step (plan, logits verification, ...).
        metrics: Agreement and perplexity (None without verification).
    """

    llm: LLMProgram
    conversion: ConversionResult
    metrics: LLMMetrics | None = None

    @property
    def program(self) -> ExportedProgram:
        """The converted ExportedProgram."""
        return self.llm.program

    @property
    def report(self) -> Report:
        """The conversion report (its ``llm`` section holds the generation metrics)."""
        return self.conversion.report

    @property
    def passed(self) -> bool | None:
        """Whether verification (logits and generation) passed; None when it did not run."""
        return self.report.passed

    def module(self) -> Any:
        """The step program as a callable module."""
        return self.llm.module()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 eos_token_id: int | None = None) -> torch.Tensor:  # fmt: skip
        """Greedy generation with the converted program (see :meth:`LLMProgram.generate`)."""
        return self.llm.generate(input_ids, max_new_tokens, attention_mask, eos_token_id)

    def save(self, path: str | Path) -> Path:
        """Write the step program as a ``.pt2``, with its spec (``emit.read_conversion``); :func:`load` reads it
        back."""
        out = self.llm.save(path, self.conversion.recorded_conversion())
        entry = {"format": "pt2", "path": str(out), "bytes": out.stat().st_size}
        # saved after the report was built (frozen): the conversion holds a new report listing the file
        conv = self.conversion
        conv.report = conv.report.with_sections((conv.report.section(Outputs) or Outputs.of([])).with_entries(entry))
        return out


def load(path: str | Path, *, trust_pickle: bool = False) -> LLMProgram:
    """Load a step program ``.pt2`` written by :meth:`LLMResult.save` (no unpickling unless trusted).

    Raises:
        AmpliteError: The file cannot be read, needs unpickling, or is not a step program.
    """
    return LLMProgram.from_program(load_program(Path(path), trust_pickle=trust_pickle))


def generate(
    model: LLMProgram | LLMResult | ExportedProgram | str | Path,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy generation with a converted step program, its result, an ExportedProgram or a ``.pt2`` path.

    Returns:
        ``[B, S + n]`` token ids, prompt first (``n <= max_new_tokens``; fewer when every row hit ``eos``).
    """
    if isinstance(model, (str, Path)):
        model = load(model)
    elif isinstance(model, ExportedProgram):
        model = LLMProgram.from_program(model)
    return model.generate(input_ids, max_new_tokens, attention_mask, eos_token_id)
