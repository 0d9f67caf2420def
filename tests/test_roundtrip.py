"""The round-trip matrix: what a user gets is the saved file, loaded in a fresh process, run on new inputs.

The matrix {fp16, bf16} × {O1, O2} × {static, dynamic batch} (8 cells) is split into four pairs of
opposite cells (each pair holds both precisions, both levels and both batch modes); fixture ``i`` runs pair
``i % 4``, so across the 8 fixtures every cell runs twice (in the default run, without the slow-marked
largest fixture, at least once) and every fixture meets every option. Each configuration is converted once
and saved as .pt2 and .onnx; one fresh Python process per fixture loads all its files
(``torch.export.load``; ONNX Runtime for fp16, ``onnx.reference`` for bf16, which ONNX Runtime's CPU
kernels lack) and runs them on inputs the conversion never saw: a larger batch (example + 3) for the
dynamic files, new values at the example's shape for the static ones. The outputs are compared with the
FP32 model under the default tolerance of the precision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amplite
from amplite.verify.compare import DEFAULT_TOLERANCES, compare
from fixtures.zoo import TEST_FIXTURES, make

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
import json, sys
import numpy as np
import torch
spec = json.loads(open(sys.argv[1]).read())
for job in spec:
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


@pytest.mark.parametrize(("name", "configs"), _params())
def test_saved_files_run_in_a_fresh_process_on_new_inputs(name: str, configs: list, tmp_path: Path) -> None:
    model, (args, kwargs) = make(name)
    assert not kwargs
    jobs, expected = [], {}
    for precision, level, dynamic in configs:
        result = amplite.convert(model, (args, kwargs), precision=precision, level=level, dynamic_batch=dynamic)
        assert result.passed, (precision, level, dynamic, result.report.outputs)
        assert not [w for w in result.report.data["warnings"] if "stayed static" in w], result.report.data["warnings"]
        new = _new_inputs(args, args[0].shape[0] + 3 if dynamic else None, seed=1)
        inputs = tmp_path / f"{precision}-{level}-{dynamic}.inputs.pt"
        torch.save(new, inputs)
        with torch.no_grad():
            reference = model(*new)
        result.tolerance = None  # skip save()'s in-process ONNX Runtime check: the fresh process below checks
        for fmt in ("pt2", "onnx"):
            if (name, fmt, dynamic) in NOT_RUN:
                continue
            path = result.save(tmp_path / f"{name}.{precision}.{level}.{'dyn' if dynamic else 'static'}.{fmt}")
            job = {"path": str(path), "inputs": str(inputs), "outputs": str(path) + ".out.pt", "precision": precision}
            jobs.append(job)
            expected[job["outputs"]] = (reference, precision)
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_RUNNER), str(spec)],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = []
    for job in jobs:
        reference, precision = expected[job["outputs"]]
        got = torch.load(job["outputs"])
        refs = list(reference) if isinstance(reference, (tuple, list)) else [reference]
        assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in refs], job["path"]
        for metrics in compare(tuple(refs), tuple(got), DEFAULT_TOLERANCES[precision]):
            if not metrics.passed:
                failures.append((Path(job["path"]).name, metrics.name, metrics.sqnr_db, metrics.notes))
    assert not failures, failures
