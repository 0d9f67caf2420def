"""bench/gpu_suite.py --dry-run: every phase of the GPU suite runs on CPU with tiny shapes and writes its files."""

from __future__ import annotations

import json
import math

from bench import gpu_suite
from bench.gpu_models import PRECISIONS, variants


def test_gpu_suite_dry_run(tmp_path):
    assert gpu_suite.main(["--dry-run", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results-gpu.dry-run.json").read_text())
    md = (tmp_path / "RESULTS-gpu.dry-run.md").read_text()
    assert not (tmp_path / "RESULTS-gpu.md").exists()  # a dry run never stands in for a GPU run
    assert data["meta"]["dry_run"] and "collected" in data["pytest"]["summary"]
    # Microbenchmark: both contract backends, the two baselines, fp16 and bf16; cuTENSOR says why it is absent.
    methods = {(r["dtype"], r["method"]) for r in data["micro"]}
    for dt in PRECISIONS:
        for m in ("contract (torch GEMM fallback)", "contract (cuTENSOR)", "permute+bmm", "einsum"):
            assert (dt, m) in methods
    assert all(r["error"].startswith("n/a") for r in data["micro"] if r["method"] == "contract (cuTENSOR)")
    # End to end: every variant at both batch sizes, each timed (no errors), fused variants with contract nodes.
    labels = {"fp32 (TF32 off)", "fp32 (TF32 on)", "autocast fp16", "autocast bf16"}
    labels |= {f"amplite {lv} {p}{f}" for lv, p in variants(dry=True) for f in ("", " + fusion")}
    rows = [r for r in data["e2e"] if r["model"] == "tiny-block"]
    assert {(r["batch"], r["variant"]) for r in rows} == {(b, v) for b in (1, 2) for v in labels}
    assert all("ms" in r and r["ms"] > 0 for r in rows), [r for r in rows if "error" in r]
    fused = [n for n in data["notes"] if n.get("variant", "").endswith("+ fusion")]
    assert fused and all(n["contract_nodes"] == 3 for n in fused)  # dynamic batch did not block fusion
    assert any(t["target"].startswith("tiny-block b1") for t in data["targets"])
    assert data["onnx"]
    # Every job ran and said so; the pool's bookkeeping is tested in test_gpu_jobs.py.
    assert {j["job"] for j in data["jobs"]} == {"pytest", "train:tiny", "train:tiny-cnn", "deploy:fx-mlp", "micro",
                                                "decode:llm-step", "e2e:tiny-block", "onnx"}  # fmt: skip
    assert all(j["status"] == "ok" and j["rows"] > 0 for j in data["jobs"]), data["jobs"]
    # Training (issue 28): each variant timed, with its loss; the targets name the ratio even where one side
    # (memory, CUDA-only) is not measured.
    train = {(r["model"], r["variant"]): r for r in data["train"]}
    assert set(train) == {(m, v) for m in ("tiny", "tiny-cnn") for v in ("fp32", "autocast", "amplite-O2")}
    assert all(r["step_ms"] > 0 and math.isfinite(r["loss_last"]) for r in train.values())
    assert any(t["target"] == "tiny: amplite-O2 / autocast step time ≤ 1.0" and t["value"] > 0 for t in data["targets"])
    # Compiled deployment (issue 31): every variant eager and compiled; the CUDA-graph rows are not planned on CPU.
    deploy = {(r["variant"], r["mode"]): r for r in data["deploy"] if "variant" in r}
    for v in ("fp32", "autocast", "amplite O1", "amplite O2", "all bf16"):
        assert deploy[(v, "compile")]["ms"] > 0 and deploy[(v, "eager")]["ms"] > 0, v
    assert deploy[("amplite O2, input check off", "compile")]["ms"] > 0
    assert not any(m in ("cudagraphs", "aoti") for _, m in deploy)
    assert any(t["target"].startswith("fx-mlp: amplite O2 compile / autocast compile") for t in data["targets"])
    # Issue 41: the backend (and why) is the report's first row, then what the budget left out; its targets.
    assert md.splitlines()[2].startswith("**Contraction backend that ran:** torch: bmm/baddbmm")
    assert "## Not run: budget" in md and "Nothing: every planned job ran." in md
    assert data["meta"]["wheels"]["status"] == "not asked (no --wheels)"
    by = {t["target"]: t for t in data["targets"]}
    assert by["tiny: amplite-O2 / fp32 (TF32 off) step time ≤ 0.5"]["value"] > 0
    assert by["tiny: amplite-O1 / fp32 (TF32 off) step time ≤ 0.5"]["met"] is None  # O1 not run: n/a, listed
    assert by["tiny-block b1: amplite O2 bf16 / autocast bf16 eager ≤ 1.0"]["value"] > 0
    fallback = [t for name, t in by.items() if "contract (torch GEMM fallback) ≥ 1.0× permute+bmm" in name]
    assert fallback and all(t["value"] > 0 for t in fallback)
    # Decode with the LLM step program: every variant, decode and prefill, both batches; kernels counted.
    dec = {(r["variant"], r["step"], r["batch"]): r for r in data["decode"]}
    labels41 = ("fp32 (TF32 off)", "all-bf16", "autocast bf16", "amplite O1 bf16", "amplite O2 bf16")
    assert set(dec) == {(v, s, b) for v in labels41 for s in ("decode", "prefill") for b in (1, 2)}
    assert all(r["ms"] > 0 for r in dec.values()) and dec[("amplite O2 bf16", "decode", 1)]["kernels"] > 0
    assert by["tiny-gpt2 decode b2 (LLM step): amplite O2 bf16 / fp32 (TF32 off) ≤ 0.5"]["value"] > 0
    assert "## Decode and prefill with the LLM step program" in md
    assert "## Fusion measurements" in md and "Measurement('cpu (dry run)', 'torch', 'bfloat16'" in md
    for section in ("## Targets", "## pytest -m gpu", "## Contraction microbenchmark", "## End-to-end latency",
                    "## ONNX Runtime", "## Training step", "## Compiled deployment", "## Jobs"):  # fmt: skip
        assert section in md


def test_install_wheels_records_a_failure_and_goes_on(tmp_path):
    """--wheels on a store without the carried parts: the status says why (loudly), the suite is not stopped."""
    out = gpu_suite.install_wheels(tmp_path / "empty")
    assert out["status"].startswith("FAILED: ") and "no manifest.json" in out["status"]
    assert out["seconds"] >= 0 and out["store"] == str(tmp_path / "empty")


def test_install_wheels_reprobes_after_installing(tmp_path, monkeypatch):
    """After installing, cached cuTENSOR verdicts are dropped so the backend line sees the new packages."""
    from amplite.ops import cutensor_backend
    from bench import carry_wheels

    monkeypatch.setattr(carry_wheels, "install", lambda store: ["a.whl", "b.whl"])
    cutensor_backend._probes[("cuda:0", None)] = cutensor_backend.Probe(False, "stale")
    assert gpu_suite.install_wheels(tmp_path)["status"] == "installed a.whl, b.whl"
    assert ("cuda:0", None) not in cutensor_backend._probes
