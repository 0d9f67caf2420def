"""bench/gpu_suite.py --dry-run: every phase of the GPU suite runs on CPU with tiny shapes and writes its files."""

from __future__ import annotations

import json

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
    assert data["onnx"] and data["training"]["error"].startswith("n/a")
    # Compiled rows (issue 31): every variant timed with CUDA graphs off; on CPU the CUDA-graph rows say n/a.
    compiled = {(r["variant"], r["cuda_graphs"]): r for r in data["compiled"]}
    for v in ("fp32", "autocast bf16", "amplite O2 bf16", "all bf16"):
        assert compiled[(v, "off")]["ms"] > 0, compiled[(v, "off")]
        assert compiled[(v, "on")]["error"].startswith("n/a")
    assert "## Compiled (torch.compile" in md
    for section in ("## Targets", "## pytest -m gpu", "## Contraction microbenchmark", "## End-to-end latency",
                    "## ONNX Runtime", "## Training step"):  # fmt: skip
        assert section in md
