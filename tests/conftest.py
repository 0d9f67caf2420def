"""Shared test fixtures: fixture model files on disk, a CLI runner, graph helpers."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from amplite.cli import app
from amplite.converter.graph_stats import node_compute_dtype
from amplite.passes.graph_utils import cast_dtype
from fixtures.write_fixtures import write

# Under pytest-xdist (`make test` runs two workers on CI's two cores) each worker computes with one intra-op
# thread, and the fresh processes tests start inherit it: two threads per worker oversubscribe the cores
# (the suite took 389 s with torch's default threads, 295 s with one, on an idle 2-core machine). An
# OMP_NUM_THREADS the user set is kept.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


#: The test modules whose ``_worker`` runs as one rank of a 2-process gloo group (:func:`start_ranks`).
RANK_WORKER_MODULES = ("tests.test_training_ddp", "tests.test_training_fsdp", "tests.test_integration_ddp",
                       "tests.test_integration_fsdp")  # fmt: skip


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's exception fails the caller.

    The ranks are forked from ``multiprocessing``'s fork server, a fresh interpreter that has imported
    :data:`RANK_WORKER_MODULES` (torch, amplite, Lightning, transformers) once per xdist worker and run
    nothing else, so each rank starts as clean as under ``spawn``. ``spawn`` re-imported all of it in every
    rank: 4-6 CPU s each, about 35 CPU s over the suite's four 2-process groups on a 2-core machine.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(RANK_WORKER_MODULES))  # read when the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-model tests (two threads on a shared 2-core machine mostly wait
    for each other: verification ran ~5x slower); restored afterwards. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def write_tiny_llama(path: Path, vocab: int, max_shard_size: str) -> Path:
    """A seeded 2-layer Llama (hidden 32, untied head) saved as a sharded safetensors checkpoint at ``path``."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True)
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path


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


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(folder)``'s JSON-able result, computed once per test run even under pytest-xdist.

    Without xdist it is computed in a fresh temporary folder. Under xdist the workers share the run's
    temporary root: the first to take the file lock computes and writes ``<name>.json``, the others read it.
    For session fixtures whose work (conversions, one fresh process for many files) no worker should repeat.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, common to every xdist worker
    done = shared / f"{name}.json"
    with FileLock(str(done) + ".lock"):
        if not done.is_file():
            folder = shared / name
            folder.mkdir(exist_ok=True)  # left by a worker whose compute raised: this one tries again
            done.write_text(json.dumps(compute(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def fresh_cli_convert(model_files: Callable, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``AMPLITE_LEVEL=O2 python -m amplite convert mlp.pt2 -o m.pt2`` in a fresh interpreter, once per test run
    (:func:`once_per_run`): ``returncode``, ``stdout``, ``stderr``, whether ``m.pt2`` was written and the report.
    Read by the test of ``python -m amplite`` and by the test of the level's source (one start-up for both)."""

    def run(folder: Path) -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "AMPLITE_LEVEL": "O2"}
        cmd = [sys.executable, "-m", "amplite", "convert", str(model_files("mlp")["pt2"]), "-o", str(folder / "m.pt2")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        report = folder / "m.report.json"
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "written": (folder / "m.pt2").is_file(),
                "report": json.loads(report.read_text()) if report.is_file() else None}  # fmt: skip

    return once_per_run(tmp_path_factory, "cli-fresh-process", run)


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
