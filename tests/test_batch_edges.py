"""Batch manifests and options at their edges: values TOML allows that no comparison refuses (nan, inf, an
empty list), and the summary a batch leaves (counts, exit code, failures first). No conversions run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amplite.batch import ManifestError, parse_manifest, run_batch
from amplite.batch.summary import failure_row, write_summary


def _manifest(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "m.pt2").write_bytes(b"model bytes")
    p = tmp_path / "zoo.toml"
    p.write_text(f'[defaults]\nprecision = "fp16"\n\n[[model]]\npath = "m.pt2"\n{extra}\n')
    return p


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        # a NaN passes no comparison: `timeout <= 0` let it through, and a worker with a NaN deadline never
        # times out; a NaN address-space limit reaches setrlimit
        ("timeout = nan", "timeout"),
        ("timeout = inf", "timeout"),
        ("max_memory_gb = nan", "max_memory_gb"),
        ("max_memory_gb = inf", "max_memory_gb"),
        ("data_max = nan", "data_max"),
        ("tolerance = { min_sqnr_db = nan }", "tolerance"),
        ("tolerance = { min_cosine = nan }", "tolerance"),
        # a job with no output format converts, writes no model and still reads `ok`
        ("formats = []", "formats"),
        # values the converter refuses: they failed each model at run time instead of stopping the batch
        ('inputs = ["x:4xZ:float32"]', "inputs"),
        ('inputs = ["x:4x8:float99"]', "inputs"),
        ('inputs = ["x:100000x100000x100:float32"]', "inputs"),  # beyond what amplite generates: not allocated
        ('dynamic_dims = ["x:abc"]', "dynamic_dims"),
        ('gpu_profile = "h9000"', "gpu_profile"),
        ("range_percentile = 150", "range_percentile"),
    ],
)
def test_bad_values_stop_the_batch_naming_the_key_and_line(tmp_path: Path, extra: str, key: str) -> None:
    p = _manifest(tmp_path, extra)
    with pytest.raises(ManifestError) as info:
        parse_manifest(p)
    assert info.value.exit_code == 2
    assert f"zoo.toml, line 6: '{key}'" in info.value.problem  # the file, the line and the key
    assert info.value.fix  # and what to write instead


@pytest.mark.parametrize("extra", ["timeout = 0.5", "max_memory_gb = 3", "data_max = 1e4", "formats = ['pt2']",
                                   "tolerance = { min_sqnr_db = 30, min_cosine = 0.99 }", "range_percentile = 99.9",
                                   "inputs = ['x:4x8:float32', 'ids:2x5:int64[0,100)']", "dynamic_dims = ['x:0']",
                                   "gpu_profile = 'A100'"])  # fmt: skip
def test_finite_positive_values_are_kept(tmp_path: Path, extra: str) -> None:
    """The refusals above are about the value: the same keys with sensible values parse, as numbers."""
    (job,) = parse_manifest(_manifest(tmp_path, extra))
    key = extra.split(" = ")[0]
    value = job.to_dict()[key]
    assert value not in (None, (), {})
    if isinstance(value, float):
        assert value == float(extra.split(" = ")[1])


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0.0, -3.0])
def test_a_timeout_option_that_is_not_a_positive_number_stops_before_anything_runs(
    tmp_path: Path, timeout: float
) -> None:
    p = _manifest(tmp_path, "")
    with pytest.raises(ManifestError) as info:
        run_batch(p, tmp_path / "out", timeout=timeout, progress=False)
    assert info.value.exit_code == 2 and "--timeout" in info.value.problem
    assert not (tmp_path / "out").exists()


def test_cli_timeout_nan_is_a_usage_error(cli, tmp_path: Path) -> None:
    res = cli("batch", _manifest(tmp_path, ""), "-o", tmp_path / "out", "--timeout", "nan", "--no-progress")
    assert res.exit_code == 2 and "--timeout" in res.stderr
    assert not (tmp_path / "out").exists()


def test_summary_counts_exit_code_and_failures_first(tmp_path: Path) -> None:
    """summary.json counts rows per status and exits 1 unless every row is ok (unverified too); summary.md
    lists the failures before the successes and says how many of each."""
    rows = [
        {**failure_row({"name": "a-ok", "path": "a.pt2"}, "ok", None), "worst_sqnr_db": 51.23},
        failure_row({"name": "b-unverified", "path": "b.pt2"}, "unverified", None),
        failure_row({"name": "c-crashed", "path": "c.pt2"}, "crashed", "the worker died: SIGSEGV — fix: report it"),
        failure_row({"name": "d-timeout", "path": "d.pt2"}, "timeout", "timed out after 5 s — fix: raise timeout"),
    ]
    js, md = write_summary(tmp_path, rows, {"source": "zoo.toml", "shard": None, "seconds": 2.0})
    doc = json.loads(js.read_text())
    assert doc["counts"] == {"ok": 1, "unverified": 1, "timeout": 1, "crashed": 1}
    assert doc["exit_code"] == 1 and [r["name"] for r in doc["models"]] == [r["name"] for r in rows]
    table = [line for line in md.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table][-1] == "a-ok"  # the one success last
    assert "51.2" in table[-1] and "SIGSEGV" in md.read_text()
    for name, picked, code in (("ok", rows[:1], 0), ("unverified", rows[1:2], 1)):
        (tmp_path / name).mkdir()
        js, _ = write_summary(tmp_path / name, picked, {"source": "zoo.toml", "shard": None, "seconds": 1.0})
        # 0 promises that every model was converted and compared with FP32: an unverified one is not
        assert json.loads(js.read_text())["exit_code"] == code, name


def test_the_resume_key_follows_the_calibration_batches_not_their_path(tmp_path: Path) -> None:
    """New calibration batches under the same path change the range rules' decisions: --resume must convert
    again (it kept the stale model). A moved directory with the same batches is the same job."""
    import os
    import shutil

    import torch

    from amplite.batch import job_key

    calib = tmp_path / "calib"
    calib.mkdir()
    torch.save((torch.ones(2, 3),), calib / "b0.pt")
    (calib / "notes.txt").write_text("not a batch")
    key = job_key(parse_manifest(_manifest(tmp_path, 'calib = "calib"'))[0])
    (calib / "notes.txt").write_text("edited notes")  # not a batch: not read, not hashed
    assert job_key(parse_manifest(_manifest(tmp_path, 'calib = "calib"'))[0]) == key
    shutil.copytree(calib, tmp_path / "moved")
    assert job_key(parse_manifest(_manifest(tmp_path, 'calib = "moved"'))[0]) == key
    torch.save((torch.full((2, 3), 1e5),), calib / "b0.pt")  # values beyond fp16: another plan
    stat = (calib / "b0.pt").stat()  # same size: a distinct mtime, or the per-process digest cache answers
    os.utime(calib / "b0.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert job_key(parse_manifest(_manifest(tmp_path, 'calib = "calib"'))[0]) != key
    torch.save((torch.ones(2, 3),), calib / "b0.pt")
    os.utime(calib / "b0.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    torch.save((torch.ones(2, 3),), calib / "b1.pt")  # one batch more
    assert job_key(parse_manifest(_manifest(tmp_path, 'calib = "calib"'))[0]) != key
