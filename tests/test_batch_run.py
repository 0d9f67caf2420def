"""Batch runs end to end: isolation of broken models, summaries, resume, fail-fast, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from amplite.batch import BatchResult, JobResult, convert_many, run_batch
from amplite.verify.compare import DEFAULT_TOLERANCES
from fixtures.write_fixtures import write
from fixtures.zoo import make
from tests.batch_models.broken import INPUTS, write_state_dict

HANG_TIMEOUT = 3  # seconds; only the hanging model gets it (it sleeps 600 s), the others keep the default


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Model files: one .pt2, fixture state dicts, broken models' state dicts and a corrupt archive."""
    d = tmp_path_factory.mktemp("zoo")
    write("mlp", d, ("pt2",))
    for name in SPECS:
        write(name, d, ("state_dict",))
    for factory in ("data_dependent", "hang", "segfault", "memory_hog"):
        write_state_dict(factory, d / f"{factory}.pt")
    (d / "corrupt.pt2").write_bytes(b"PK\x03\x04" + bytes(60))
    return d


def _entry(name: str, path: str, **keys: object) -> str:
    lines = [f'name = "{name}"', f'path = "{path}"']
    for k, v in keys.items():
        lines.append(f"{k} = {_toml(v)}")
    return "[[model]]\n" + "\n".join(lines) + "\n"


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


#: ``--input`` specs matching each fixture's example inputs.
SPECS = {
    "mlp": "x:4x32:float32",
    "rmsnorm": "x:4x64:float32",
    "embedding": "ids:4x12:int64[0,500)",
    "causal": "x:2x16x64:float32",
    "cnn": "x:2x3x32x32:float32",
    "transformer": "ids:2x16:int64[0,1000)",
    "overflow": "x:4x16:float32",
}


def _fixture_entry(name: str, fixture: str, **keys: object) -> str:
    path = f"{fixture}.state.pt"
    return _entry(name, path, model_factory=f"fixtures.zoo:{fixture}", inputs=[SPECS[fixture]], **keys)


def _broken(name: str, factory: str, **keys: object) -> str:
    return _entry(
        name, f"{factory}.pt", model_factory=f"tests.batch_models.broken:{factory}", inputs=INPUTS, **keys
    )


def _twelve(zoo: Path) -> Path:
    entries = [
        _entry("mlp-pt2", "mlp.pt2"),
        _entry("mlp-bf16", "mlp.pt2", precision="bf16", level="O2"),
        _fixture_entry("mlp", "mlp"),
        _fixture_entry("rmsnorm", "rmsnorm", precision="bf16"),
        _fixture_entry("embedding", "embedding"),
        _fixture_entry("causal", "causal", keep_fp32=["op:scaled_dot_product_attention*"]),
        _fixture_entry("cnn", "cnn"),
        _fixture_entry("transformer", "transformer", tolerance={"min_sqnr_db": 35}),
        _fixture_entry("overflow", "overflow"),
        _entry("corrupt", "corrupt.pt2"),
        _broken("export-fails", "data_dependent"),
        _broken("hangs", "hang", timeout=HANG_TIMEOUT),
    ]
    manifest = zoo / "twelve.toml"
    manifest.write_text('[defaults]\nprecision = "fp16"\n\n' + "\n".join(entries))
    return manifest


def _rows(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((out / "summary.json").read_text())["models"]}


def test_twelve_models_three_broken_then_resume(zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_batch(_twelve(zoo), out, jobs=2, progress=False, trust_code=True)
    rows = _rows(out)
    assert result.exit_code == 1 and len(rows) == 12
    assert result.counts == {"ok": 9, "error": 2, "timeout": 1}, {n: r["error"] for n, r in rows.items()}
    assert "corrupt zip archive" in rows["corrupt"]["error"]
    assert "torch.export could not trace" in rows["export-fails"]["error"]
    assert "broken.py" in rows["export-fails"]["error"] and " — fix: " in rows["export-fails"]["error"]
    assert (
        rows["hangs"]["status"] == "timeout" and f"timed out after {HANG_TIMEOUT} s" in rows["hangs"]["error"]
    )
    for name, row in rows.items():
        if row["status"] != "ok":
            assert row["files"] == [] and not (out / name / "model.pt2").exists()
            continue
        floor = 35 if name == "transformer" else DEFAULT_TOLERANCES[row["precision"]].min_sqnr_db
        assert row["worst_sqnr_db"] == "inf" or row["worst_sqnr_db"] >= floor
        assert row["params"] > 0 and 0 < row["low_precision_share"] <= 1 and row["casts"] >= 0
        assert 0 < row["size_ratio"] <= 1 and row["seconds"] > 0
        report = json.loads((out / name / "report.json").read_text())
        assert report["verification"]["passed"] is True and report["config"]["precision"] == row["precision"]
    assert rows["mlp-bf16"]["size_ratio"] == pytest.approx(0.5, abs=0.01)  # O2 stores bf16 weights
    # The converted model is a real .pt2 that matches the FP32 model on its inputs.
    model, (args, _) = make("mlp")
    converted = torch.export.load(str(out / "mlp-pt2" / "model.pt2")).module()
    with torch.no_grad():
        ref, got = model(*args), converted(*args)
    assert torch.linalg.norm(ref - got) / torch.linalg.norm(ref) < 0.01
    md = (out / "summary.md").read_text()
    assert md.startswith("# amplite batch: 9 ok, 2 error, 1 timeout") and md.count("\n| ") == 13
    assert not (out / ".staging").exists()

    mtime = (out / "cnn" / "model.pt2").stat().st_mtime_ns
    again = run_batch(_twelve(zoo), out, jobs=2, resume=True, progress=False, trust_code=True)
    rerun = sorted(r.name for r in again.results if not r.row["resumed"])
    assert rerun == ["corrupt", "export-fails", "hangs"] and again.exit_code == 1
    assert again.counts == result.counts
    assert (out / "cnn" / "model.pt2").stat().st_mtime_ns == mtime


def test_crash_oom_missing_and_verification_failure_are_reported(zoo: Path, tmp_path: Path) -> None:
    manifest = zoo / "bad.toml"
    manifest.write_text(
        "\n".join(
            [
                _broken("segv", "segfault"),
                _broken("hog", "memory_hog", max_memory_gb=4),
                _entry("missing", "nope.pt2"),
                _fixture_entry("overflow-o3", "overflow", level="O3"),
            ]
        )
    )
    result = run_batch(manifest, tmp_path / "out", jobs=2, progress=False, trust_code=True)
    rows = _rows(tmp_path / "out")
    assert result.exit_code == 1
    assert {n: r["status"] for n, r in rows.items()} == {
        "segv": "crashed", "hog": "oom", "missing": "error", "overflow-o3": "verify_failed",
    }  # fmt: skip
    assert "SIGSEGV" in rows["segv"]["error"] and "broken.py" in rows["segv"]["error"]
    assert "can't allocate memory" in rows["hog"]["error"] and "max_memory_gb" in rows["hog"]["error"]
    assert "does not exist (manifest line" in rows["missing"]["error"]
    assert "NaN/Inf" in rows["overflow-o3"]["error"]
    # a model that converted but failed verification keeps its files for inspection
    assert (tmp_path / "out" / "overflow-o3" / "model.pt2").is_file()
    assert "Segmentation fault" in (tmp_path / "out" / "segv" / "worker.log").read_text()


def test_fail_fast_and_plain_progress(zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [
        {"name": "corrupt", "path": str(zoo / "corrupt.pt2")},
        {"name": "a", "path": str(zoo / "mlp.pt2")},
        {"name": "b", "path": str(zoo / "mlp.pt2"), "precision": "bf16"},
    ]
    result = convert_many(jobs, tmp_path / "out", workers=1, fail_fast=True, progress="plain")
    assert [r.status for r in result.results] == ["error", "cancelled", "cancelled"]
    assert all("--fail-fast stopped the batch after 'corrupt' failed" in r.error for r in result.results[1:])
    assert result.exit_code == 1 and not (tmp_path / "out" / "a").exists()
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0] == "amplite batch: 3 model(s)"
        and lines[1].startswith("[1/3] error")
        and "corrupt" in lines[1]
    )
    assert lines[-1].startswith("done: 3/3")


def test_ctrl_c_keeps_finished_results_and_leaves_nothing_half_written(zoo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    jobs = [
        {"name": "hangs", "path": str(zoo / "hang.pt"), "model_factory": "tests.batch_models.broken:hang",
         "inputs": INPUTS, "timeout": 120},
        {"name": "mlp", "path": str(zoo / "mlp.pt2")},
    ]  # fmt: skip
    seen: list[JobResult] = []

    def interrupt(result: JobResult) -> None:
        seen.append(result)
        raise KeyboardInterrupt  # as if Ctrl-C arrived while the hanging model runs

    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        convert_many(jobs, out, workers=2, on_result=interrupt)
    assert time.perf_counter() - start < 60  # the hanging worker was killed, not waited for
    assert [r.name for r in seen] == ["mlp"]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["interrupted"] is True and doc["exit_code"] == 1
    assert {r["name"]: r["status"] for r in doc["models"]} == {"hangs": "cancelled", "mlp": "ok"}
    assert (out / "mlp" / "model.pt2").is_file() and not (out / "hangs").exists()
    assert sorted(p.name for p in out.iterdir()) == ["mlp", "summary.json", "summary.md"]


def test_batch_result_api(zoo: Path, tmp_path: Path) -> None:
    result = convert_many([{"path": str(zoo / "mlp.pt2")}], tmp_path / "out", workers=1)
    assert isinstance(result, BatchResult) and result.exit_code == 0
    assert [r.name for r in result.succeeded] == ["mlp"] and result.failed == []
    assert result.summary_json.is_file() and result.summary_md.is_file()
    assert result.results[0].row["output_dir"] == "mlp"


_SCRIPT = """
import sys
from amplite.batch import run_batch
try:
    run_batch(sys.argv[1], sys.argv[2], jobs=2, progress="plain", trust_code=True)
except KeyboardInterrupt:
    sys.exit(130)
"""  # no `if __name__ == "__main__"` guard on purpose: workers must not re-import the caller's script


def test_real_sigint_stops_cleanly(zoo: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "int.toml"
    manifest.write_text(_broken("hangs", "hang", timeout=120).replace('path = "', f'path = "{zoo}/') + "\n"
                        + _entry("mlp", str(zoo / "mlp.pt2")))  # fmt: skip
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "out"
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps an ignored
    # SIGINT ignored: restore the default so the run sees Ctrl-C however the suite itself was started.
    proc = subprocess.Popen([sys.executable, str(script), str(manifest), str(out)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[1/2]"):
            proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, lines
    assert "ok" in lines[1] and "mlp" in lines[1]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["interrupted"] is True
    assert {r["name"]: r["status"] for r in doc["models"]} == {"hangs": "cancelled", "mlp": "ok"}
    assert sorted(p.name for p in out.iterdir()) == ["mlp", "summary.json", "summary.md"]


def test_verify_false_is_unverified_not_ok(zoo: Path, tmp_path: Path) -> None:
    """`verify = false` rows get their own status, and exit code 0 keeps meaning "converted and verified"."""
    out = tmp_path / "out"
    jobs = [{"name": "a", "path": str(zoo / "mlp.pt2"), "verify": False}, {"name": "b", "path": str(zoo / "mlp.pt2")}]
    result = convert_many(jobs, out, workers=1)
    assert {r.name: r.status for r in result.results} == {"a": "unverified", "b": "ok"}
    assert result.exit_code == 1 and result.failed == [] and [r.name for r in result.unverified] == ["a"]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["counts"] == {"ok": 1, "unverified": 1} and doc["exit_code"] == 1
    assert _rows(out)["a"]["verified"] is None and (out / "a" / "model.pt2").is_file()
    assert "1 ok, 1 unverified" in (out / "summary.md").read_text()
    again = convert_many(jobs, out, workers=1, resume=True)  # a converted model is not redone
    assert all(r.row["resumed"] for r in again.results) and again.counts == {"ok": 1, "unverified": 1}


def test_sigterm_stops_cleanly_with_a_complete_summary(zoo: Path, tmp_path: Path) -> None:
    """SLURM/Kubernetes/CI preemption: SIGTERM to `amplite batch` ends it like Ctrl-C, with rc 143."""
    manifest = tmp_path / "term.toml"
    manifest.write_text(_broken("hangs", "hang", timeout=60).replace('path = "', f'path = "{zoo}/') + "\n"
                        + _entry("mlp", str(zoo / "mlp.pt2")))  # fmt: skip
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "amplite", "batch", str(manifest), "-o", str(out), "--jobs", "2", "--no-progress",
           "--trust-code"]  # the manifest names model factories
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env)
    watchdog = threading.Timer(90, proc.kill)  # without a plain line to wait for, do not hang the suite
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[1/2]"):  # mlp finished; the hanging model is still running
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
    stderr = proc.stderr.read()
    assert rc == 143, (lines, stderr)
    assert "SIGTERM" in stderr and "Traceback" not in stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["interrupted"] is True and doc["exit_code"] == 1 and doc["counts"] == {"ok": 1, "cancelled": 1}
    rows = {r["name"]: r for r in doc["models"]}
    assert rows["mlp"]["status"] == "ok" and rows["hangs"]["status"] == "cancelled"
    assert "SIGTERM" in rows["hangs"]["error"]
    assert "**Interrupted**" in (out / "summary.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["mlp", "summary.json", "summary.md"]  # no .staging
