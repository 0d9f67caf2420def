"""bench/bench_budget.py: amplite's accuracy-budget search against onnxconverter-common's, on one fixture."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("onnxconverter_common")

from bench.bench_budget import COLUMNS, main, sqnr_db, worst_sqnr


def test_sqnr_matches_its_definition() -> None:
    ref = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    noise = np.full_like(ref, 1e-3)
    want = 20 * math.log10(np.linalg.norm(ref.astype(np.float64)) / np.linalg.norm(noise.astype(np.float64)))
    assert sqnr_db(ref, ref + noise) == pytest.approx(want, abs=1e-3)
    assert sqnr_db(ref, ref) == math.inf
    bad = ref.copy()
    bad[0, 0] = np.nan
    assert math.isnan(worst_sqnr([ref, ref], [ref, bad]))  # a non-finite output fails every >= threshold
    assert worst_sqnr([ref, ref], [ref + noise, ref + 10 * noise]) == pytest.approx(want - 20, abs=1e-3)


def test_quick_run_prints_both_tools_against_one_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(COLUMNS)
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:] if ln.startswith("| mlp ")]
    assert [r[COLUMNS.index("tool")] for r in body] == ["amplite", "occ", "occ+ref"]
    assert len({r[COLUMNS.index("tol dB")] for r in body}) == 1  # the same tolerance for every tool
    ours, occ, occ_ref = rows
    assert ours["tol_db"] == pytest.approx(ours["plan_sqnr"] + 3.0, abs=0.01)
    assert ours["met"] and ours["sqnr_own"] >= ours["tol_db"] and ours["moved"] >= 1 and ours["trials"] >= 1
    assert ours["met_ref"] == (ours["sqnr_ref"] >= ours["tol_db"])
    # occ calls validate_fn for its FP32 sanity check, at least one attempt, and the final model
    assert occ["trials"] >= 3 and occ["wall_s"] > 0
    if occ_ref["met"]:  # judged by onnx.reference itself, so its own verdict holds there
        assert occ_ref["met_ref"] and occ_ref["sqnr_ref"] >= occ_ref["tol_db"]
    assert any(ln.startswith("- mlp:") and "wall amplite/occ =" in ln for ln in lines)
