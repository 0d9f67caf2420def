"""Converted LLMs that generate: one step program (prefill + decode, KV cache in and out, dynamic batch,
prompt and cache length), greedy generation, save/load, and verification by token agreement and
perplexity (docs/llm.md).

Layer: above ``api`` (it converts with :func:`amplite.convert`), below ``save`` (``amplite convert DIR``
runs the generation check of ``amplite.llm.checkpoint``), ``gate`` and ``cli``.
"""

from __future__ import annotations

from amplite.llm.convert import convert_llm, verify_llm
from amplite.llm.metrics import DEFAULT_LLM_CRITERIA, LLMMetrics
from amplite.llm.result import LLMProgram, LLMResult, generate, load
from amplite.llm.step import CacheShape, LMStep

__all__ = [
    "DEFAULT_LLM_CRITERIA",
    "CacheShape",
    "LLMMetrics",
    "LLMProgram",
    "LLMResult",
    "LMStep",
    "convert_llm",
    "generate",
    "load",
    "verify_llm",
]
