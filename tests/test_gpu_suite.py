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
        for m in ("contract (einsum backend)", "contract (cuTENSOR)", "permute+bmm", "einsum"):
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
    assert {j["job"] for j in data["jobs"]} == {"pytest", "train:tiny", "deploy:fx-mlp", "micro", "e2e:tiny-block",
                                                "onnx"}  # fmt: skip
    assert all(j["status"] == "ok" and j["rows"] > 0 for j in data["jobs"]), data["jobs"]
    # Training (issue 28): each variant timed, with its loss; the targets name the ratio even where one side
    # (memory, CUDA-only) is not measured.
    train = {r["variant"]: r for r in data["train"]}
    assert set(train) == {"autocast", "amplite-O2"} and all(r["step_ms"] > 0 for r in train.values())
    assert all(math.isfinite(r["loss_last"]) for r in train.values())
    assert any(t["target"] == "tiny: amplite-O2 / autocast step time ≤ 1.0" and t["value"] > 0 for t in data["targets"])
    # Compiled deployment (issue 31): every variant eager and compiled; the CUDA-graph rows are not planned on CPU.
    deploy = {(r["variant"], r["mode"]): r for r in data["deploy"] if "variant" in r}
    for v in ("fp32", "autocast", "amplite O1", "amplite O2", "all bf16"):
        assert deploy[(v, "compile")]["ms"] > 0 and deploy[(v, "eager")]["ms"] > 0, v
    assert deploy[("amplite O2, input check off", "compile")]["ms"] > 0
    assert not any(m in ("cudagraphs", "aoti") for _, m in deploy)
    assert any(t["target"].startswith("fx-mlp: amplite O2 compile / autocast compile") for t in data["targets"])
    for section in ("## Targets", "## pytest -m gpu", "## Contraction microbenchmark", "## End-to-end latency",
                    "## ONNX Runtime", "## Training step", "## Compiled deployment", "## Jobs"):  # fmt: skip
        assert section in md
