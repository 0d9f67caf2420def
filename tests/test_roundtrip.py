"""The round-trip matrix: what a user gets is the saved file, loaded in a fresh process, run on new inputs.

The matrix {fp16, bf16} × {O1, O2} × {static, dynamic batch} (8 cells) is split into four pairs of
opposite cells (each pair holds both precisions, both levels and both batch modes); fixture ``i`` runs pair
``i % 4``, so across the 8 fixtures every cell runs twice (in the default run, without the slow-marked
largest fixture, at least once) and every fixture meets every option. Each configuration is converted once
and saved as .pt2 and .onnx; one fresh Python process (one for the whole session, shared by the xdist
workers) loads all the files
(``torch.export.load``; ONNX Runtime for fp16, ``onnx.reference`` for bf16, which ONNX Runtime's CPU
kernels lack) and runs them on inputs the conversion never saw: a larger batch (example + 3) for the
dynamic files, new values at the example's shape for the static ones. The outputs are compared with the
FP32 model under the default tolerance of the precision.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import amplite
from amplite.verify.compare import DEFAULT_TOLERANCES, compare
from fixtures.zoo import TEST_FIXTURES, make
from tests import fresh
from tests.conftest import once_per_run

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [
    [("fp16", "O1", False), ("bf16", "O2", True)],
    [("fp16", "O2", True), ("bf16", "O1", False)],
    [("fp16", "O1", True), ("bf16", "O2", False)],
    [("fp16", "O2", False), ("bf16", "O1", True)],
]
#: Cells that are not run, with why (each is a known defect outside amplite's conversion).
NOT_RUN = {
    ("gru", "onnx", True): "onnxruntime crashes (SIGSEGV) creating a session for a dynamic-batch GRU",
}
SLOW = {"transformer"}  # the largest fixture (twice the time of the others)

_RUNNER = """
import json, sys, traceback
import numpy as np
import torch
spec = json.loads(open(sys.argv[1]).read())
errors = {}
for job in spec:
    try:
        args = torch.load(job["inputs"])
        if job["path"].endswith(".pt2"):
            with torch.no_grad():
                out = torch.export.load(job["path"]).module()(*args)
            outs = [t.float() for t in (out if isinstance(out, (tuple, list)) else [out])]
        else:
            import onnx
            feeds_of = lambda names: {n: a.numpy() for n, a in zip(names, args)}
            if job["precision"] == "bf16":  # ONNX Runtime's CPU provider has no bf16 kernels
                from onnx.reference import ReferenceEvaluator
                ev = ReferenceEvaluator(onnx.load(job["path"]))
                res = ev.run(None, feeds_of(ev.input_names))
            else:
                import onnxruntime as ort
                sess = ort.InferenceSession(job["path"], providers=["CPUExecutionProvider"])
                res = sess.run(None, feeds_of([i.name for i in sess.get_inputs()]))
            outs = [torch.from_numpy(np.asarray(r).astype(np.float32)) for r in res]
        torch.save(outs, job["outputs"])
    except Exception:  # this file's failure, reported for its own test; the other files still run
        errors[job["path"]] = traceback.format_exc()[-3000:]
print(json.dumps(errors))
"""


def _new_inputs(example: tuple, batch: int | None, seed: int) -> tuple:
    """Inputs like ``example`` with new values; dim 0 resized to ``batch`` when given."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in example:
        shape = (batch, *t.shape[1:]) if batch is not None else tuple(t.shape)
        if t.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g, dtype=t.dtype) * t.std() + t.mean())
        else:
            out.append(torch.randint(0, int(t.max()) + 1, shape, generator=g, dtype=t.dtype))
    return tuple(out)


def _params() -> list:
    out = []
    for i, name in enumerate(TEST_FIXTURES):
        marks = [pytest.mark.slow] if name in SLOW else []
        out.append(pytest.param(name, PAIRS[i % len(PAIRS)], id=name, marks=marks))
    return out


@pytest.fixture(scope="session")
def fresh_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per fixture name: the conversion checks and the per-file results of ONE fresh process for all of them.

    Every fixture this session selected (``-m``/``-k`` respected) is converted and saved here, then a single
    fresh process loads and runs every file (one Python start-up instead of one per fixture); once per run,
    shared by the xdist workers (:func:`tests.conftest.once_per_run`).
    """
    selected = {item.callspec.params["name"]: item.callspec.params["configs"] for item in request.session.items
                if getattr(item, "originalname", None) == TEST and item.path == Path(__file__)}  # fmt: skip
    return once_per_run(tmp_path_factory, "roundtrip", lambda folder: _convert_and_run(selected, folder))


def _convert_and_run(selected: dict[str, list], tmp: Path) -> dict[str, Any]:
    """Convert and save every configuration of ``selected`` in ``tmp``, run all files in one fresh process, compare."""
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    jobs, expected = [], {}
    for name, configs in selected.items():
        out[name] = {"convert": [], "files": [], "error": None}
        try:
            model, (args, kwargs) = make(name)
            assert not kwargs
            for precision, level, dynamic in configs:
                result = amplite.convert(model, (args, kwargs), precision=precision, level=level,
                                         dynamic_batch=dynamic)  # fmt: skip
                static = [w for w in result.report.data["warnings"] if "stayed static" in w]
                out[name]["convert"].append([precision, level, dynamic, bool(result.passed),
                                             repr(result.report.outputs), static])  # fmt: skip
                new = _new_inputs(args, args[0].shape[0] + 3 if dynamic else None, seed=1)
                inputs = tmp / f"{name}-{precision}-{level}-{dynamic}.inputs.pt"
                torch.save(new, inputs)
                with torch.no_grad():
                    reference = model(*new)
                result.tolerance = None  # skip save()'s in-process ONNX Runtime check: the fresh process checks
                for fmt in ("pt2", "onnx"):
                    if (name, fmt, dynamic) in NOT_RUN:
                        continue
                    stem = f"{name}.{precision}.{level}.{'dyn' if dynamic else 'static'}.{fmt}"
                    path = result.save(tmp / stem)
                    job = {"name": name, "path": str(path), "inputs": str(inputs), "outputs": str(path) + ".out.pt",
                           "precision": precision}  # fmt: skip
                    jobs.append(job)
                    expected[job["outputs"]] = (reference, precision)
        except Exception as exc:  # reported by (and fails) this fixture's test only
            out[name]["error"] = f"{type(exc).__name__}: {exc}"
            jobs = [j for j in jobs if j["name"] != name]
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = fresh.run([sys.executable, "-c", textwrap.dedent(_RUNNER), str(spec)], timeout=600, env=env)
    errors = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    for job in jobs:
        entry = {"file": Path(job["path"]).name, "returncode": proc.returncode, "stderr": proc.stderr[-3000:],
                 "error": errors.get(job["path"]), "shapes": None, "expected_shapes": None, "failures": []}  # fmt: skip
        out[job["name"]]["files"].append(entry)
        if proc.returncode != 0 or entry["error"]:
            continue
        reference, precision = expected[job["outputs"]]
        got = torch.load(job["outputs"])
        refs = list(reference) if isinstance(reference, (tuple, list)) else [reference]
        entry["shapes"] = [list(t.shape) for t in got]
        entry["expected_shapes"] = [list(t.shape) for t in refs]
        if entry["shapes"] != entry["expected_shapes"]:
            continue
        for metrics in compare(tuple(refs), tuple(got), DEFAULT_TOLERANCES[precision]):
            if not metrics.passed:
                entry["failures"].append([metrics.name, metrics.sqnr_db, str(metrics.notes)])
    return out


TEST = "test_saved_files_run_in_a_fresh_process_on_new_inputs"


@pytest.mark.parametrize(("name", "configs"), _params())
def test_saved_files_run_in_a_fresh_process_on_new_inputs(name: str, configs: list, fresh_results: dict) -> None:
    got = fresh_results[name]
    assert got["error"] is None, got["error"]
    assert [c[:3] for c in got["convert"]] == [list(c) for c in configs]
    for precision, level, dynamic, passed, outputs, static in got["convert"]:
        assert passed, (precision, level, dynamic, outputs)
        assert not static, static
    files = [(p, fmt, d) for p, _, d in configs for fmt in ("pt2", "onnx") if (name, fmt, d) not in NOT_RUN]
    assert len(got["files"]) == len(files), got["files"]
    failures = []
    for entry in got["files"]:
        assert entry["returncode"] == 0, entry["stderr"]
        assert entry["error"] is None, (entry["file"], entry["error"])
        assert entry["shapes"] == entry["expected_shapes"], entry["file"]
        failures += [(entry["file"], *f) for f in entry["failures"]]
    assert not failures, failures
