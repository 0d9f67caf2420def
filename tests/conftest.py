"""Shared test fixtures: fixture model files on disk, a CLI runner, graph helpers."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from amplite.cli import app
from amplite.converter.graph_stats import node_compute_dtype
from amplite.passes.graph_utils import cast_dtype
from fixtures.write_fixtures import write

# Every report any test makes a command write is validated against the published schema as it is written
# (amplite/report/schema.py): a report that does not match is an InternalError, so the whole suite checks it.
os.environ.setdefault("AMPLITE_VALIDATE_REPORTS", "1")


@pytest.fixture(scope="session")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[callable]:
    """``model_files(name)`` writes fixture ``name`` once per session in every format."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, dict[str, Path]] = {}

    def get(name: str) -> dict[str, Path]:
        if name not in cache:
            cache[name] = write(name, root)
        return cache[name]

    yield get


class Cli:
    """Runs the typer app in-process; ``.code``, ``.stdout`` and ``.stderr`` of the last call."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str | Path) -> object:
        return self.runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def cli() -> Cli:
    return Cli()


def compute_dtypes(graph: torch.fx.Graph, op: object) -> list[torch.dtype | None]:
    """Compute dtype of every node calling ``op`` (an ATen overload packet or overload)."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if target is op or getattr(target, "overloadpacket", None) is op:
            out.append(node_compute_dtype(node))
    return out


def count_casts(graph: torch.fx.Graph) -> int:
    """Pure dtype casts in a graph."""
    return sum(1 for n in graph.nodes if cast_dtype(n) is not None)
