"""Batch manifests: parsing, validation errors with lines, resume keys, sharding, merging (no conversions)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from amplite.batch import (
    Job,
    ManifestError,
    MergeError,
    job_key,
    load_jobs,
    merge_shards,
    parse_manifest,
    run_batch,
)
from amplite.batch.keys import select_shard, shard_of
from amplite.batch.summary import failure_row, write_summary
from amplite.verify.compare import DEFAULT_TOLERANCES


def _manifest(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m.pt2").write_bytes(b"model bytes")
    p = tmp_path / "zoo.toml"
    p.write_text(text.lstrip("\n"))
    return p


def test_defaults_overrides_and_relative_paths(tmp_path: Path) -> None:
    p = _manifest(
        tmp_path,
        """
[defaults]
precision = "bf16"
keep_fp32 = ["op:softmax*"]
timeout = 30

[[model]]
path = "m.pt2"

[[model]]
name = "second"
path = "m.pt2"
precision = "fp16"
level = 2
inputs = ["ids:2x16:int64[0,1000)"]
tolerance = { min_sqnr_db = 30 }
""",
    )
    a, b = parse_manifest(p, defaults={"precision": "fp16", "seed": 3})
    assert (a.name, a.options.precision, a.options.keep_fp32, a.timeout, a.seed) == (
        "m", "bf16", ("op:softmax*",), 30.0, 3)  # fmt: skip
    assert a.path == str((tmp_path / "m.pt2").resolve())
    assert (b.name, b.options.precision, b.options.level, b.inputs) == ("second", "fp16", "O2",
                                                                        ("ids:2x16:int64[0,1000)",))  # fmt: skip
    # the manifest's threshold over fp16's default, the others fp16's
    assert b.options.tolerance == replace(DEFAULT_TOLERANCES["fp16"], min_sqnr_db=30.0)
    assert (a.line, b.line) == (7, 10)  # the name line, else the path line


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        (
            '[[model]]\npath = "m.pt2"\n\n[[model]]\npath = "m.pt2"\nprecison = "fp16"\n',
            6,
            "unknown key 'precison'",
        ),
        ('[defaults]\nlevl = "O2"\n\n[[model]]\npath = "m.pt2"\n', 2, "unknown key 'levl'"),
        ('jobs = 4\n[[model]]\npath = "m.pt2"\n', 1, "unknown top-level key 'jobs'"),
        ('[[model]]\npath = "m.pt2"\nlevel = "O7"\n', 3, "unknown level 'O7'"),
        ('[[model]]\npath = "m.pt2"\nverify = "yes"\n', 3, "'verify': expected true or false"),
        ('[[model]]\npath = "m.pt2"\ntimeout = -1\n', 3, "'timeout'"),
        (
            '[[model]]\npath = "m.pt2"\n\ttolerance = { min_sqnr = 3 }\n',
            3,
            "unknown tolerance key 'min_sqnr'",
        ),
        (  # a [model.tolerance] sub-table: the key's own line, not the entry's (issue 14)
            '[[model]]\nname = "a"\npath = "m.pt2"\n\n[model.tolerance]\nmin_sqnr_db = 30\nmin_sqnr = 3\n',
            7,
            "unknown tolerance key 'min_sqnr'",
        ),
        (
            '[[model]]\nname = "a"\npath = "m.pt2"\n[model.tolerance]\nmin_cosine = 0.9\n'
            '[[model]]\nname = "b"\npath = "m.pt2"\n[model.tolerance]\nmin_cosine = 0.9\nmax_mis = 1\n',
            11,
            "unknown tolerance key 'max_mis'",
        ),
        (
            '[defaults]\nprecision = "fp16"\n[defaults.tolerance]\nmin_cosine = "x"\n[[model]]\npath = "m.pt2"\n',
            4,
            "tolerance values must be numbers",
        ),
        ('[[model]]\npath = "m.pt2"\nformats = ["tflite"]\n', 3, "output format"),
        ('[[model]]\nname = "a/b"\npath = "m.pt2"\n', 2, "not a valid directory name"),
        ('[defaults]\npath = "m.pt2"\n[[model]]\nname = "x"\npath = "m.pt2"\n', 2, "per model"),
    ],
)
def test_bad_manifest_names_key_and_line(tmp_path: Path, body: str, line: int, words: str) -> None:
    p = _manifest(tmp_path, body)
    with pytest.raises(ManifestError) as info:
        parse_manifest(p)
    assert f"zoo.toml, line {line}:" in info.value.one_line()
    assert words in info.value.one_line()
    assert " — fix: " in info.value.one_line() and info.value.exit_code == 2


def test_duplicate_names_name_both_lines(tmp_path: Path) -> None:
    p = _manifest(tmp_path, '[[model]]\nname = "m"\npath = "a.pt2"\n\n[[model]]\npath = "m.pt2"\n')
    with pytest.raises(ManifestError, match=r"duplicate model name 'm' \(lines 2 and 6\)"):
        parse_manifest(p)


def test_syntax_error_and_empty_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"invalid TOML.*line 2"):
        parse_manifest(_manifest(tmp_path, '[[model]]\npath = "m.pt2\n'))
    with pytest.raises(ManifestError, match=r"no \[\[model\]\] entries"):
        parse_manifest(_manifest(tmp_path, '[defaults]\nprecision = "fp16"\n'))
    with pytest.raises(ManifestError, match="does not exist"):
        parse_manifest(tmp_path / "nope.toml")


def test_directory_and_glob_sources(tmp_path: Path) -> None:
    for rel in ("zoo/a.pt2", "zoo/b.pt2", "zoo/notes.txt", "other/a.pt2"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    jobs = load_jobs(tmp_path / "zoo", defaults={"precision": "bf16"})
    assert [(j.name, j.options.precision) for j in jobs] == [("a", "bf16"), ("b", "bf16")]
    jobs = load_jobs(str(tmp_path / "*" / "a.pt2"))  # same file name twice: named by relative path
    assert sorted(j.name for j in jobs) == ["other-a", "zoo-a"]
    with pytest.raises(ManifestError, match="no model files match"):
        load_jobs(str(tmp_path / "*.onnx"))


def test_job_key_tracks_content_and_output_settings_only(tmp_path: Path) -> None:
    model = tmp_path / "m.pt2"
    model.write_bytes(b"v1")
    base = Job.from_dict({"path": str(model)})
    assert job_key(base) == job_key(Job.from_dict({"path": str(model), "timeout": 5, "name": "other"}))
    assert job_key(base) != job_key(Job.from_dict({"path": str(model), "precision": "bf16"}))
    assert job_key(base) != job_key(Job.from_dict({"path": str(model), "keep_fp32": ["op:mm*"]}))
    before = job_key(base)
    model.write_bytes(b"v2")
    assert job_key(base) != before


def test_shards_partition_deterministically(tmp_path: Path) -> None:
    jobs = [Job.from_dict({"name": f"model{i:02d}", "path": "x.pt2"}) for i in range(40)]
    shards = [select_shard(jobs, (i, 4)) for i in range(4)]
    names = [j.name for s in shards for j in s]
    assert sorted(names) == sorted(j.name for j in jobs)  # every model in exactly one shard
    assert all(shards[i] for i in range(4))
    # a model's shard depends only on its name: removing others moves nothing
    assert [j.name for j in select_shard(jobs[::2], (1, 4))] == [j.name for j in shards[1] if j in jobs[::2]]
    assert shard_of("model07", 4) == shard_of("model07", 4)


@pytest.mark.parametrize("spec", ["4/4", "1", "-1/2", "a/b", "0/0"])
def test_bad_shard_and_options_are_usage_errors(tmp_path: Path, spec: str) -> None:
    p = _manifest(tmp_path, '[[model]]\npath = "m.pt2"\n')
    with pytest.raises(ManifestError, match="--shard") as info:
        run_batch(p, tmp_path / "out", shard=spec, progress=False)
    assert info.value.exit_code == 2
    with pytest.raises(ManifestError, match="--jobs"):
        run_batch(p, tmp_path / "out", jobs=0, progress=False)
    assert not (tmp_path / "out").exists()


def _shard_summary(d: Path, shard: str | None, names: list[str], status: str = "ok") -> Path:
    rows = [failure_row({"name": n, "path": f"{n}.pt2"}, status, None) for n in names]
    write_summary(d, rows, {"source": "zoo.toml", "shard": shard, "seconds": 1.0})
    return d


def test_merge_validates_shards(tmp_path: Path) -> None:
    s0 = _shard_summary(tmp_path / "s0", "0/3", ["a", "b"])
    s1 = _shard_summary(tmp_path / "s1", "1/3", ["c"], status="timeout")
    s2 = _shard_summary(tmp_path / "s2", "2/3", [])
    merged = merge_shards([s0, s1, s2], tmp_path / "all")
    assert sorted(r.name for r in merged.results) == ["a", "b", "c"]
    assert merged.exit_code == 1 and merged.counts == {"ok": 2, "timeout": 1}
    doc = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert doc["models"][0]["output_dir"] == "../s0/a" and doc["exit_code"] == 1
    assert "| c | timeout |" in (tmp_path / "all" / "summary.md").read_text()
    with pytest.raises(MergeError, match="2/3 missing"):
        merge_shards([s0, s1], tmp_path / "x")
    with pytest.raises(MergeError, match="given twice"):
        merge_shards([s0, s0, s1, s2], tmp_path / "x")
    dup = _shard_summary(tmp_path / "d", "1/3", ["a"])
    with pytest.raises(MergeError, match="'a' is in both"):
        merge_shards([s0, dup, s2], tmp_path / "x")
    with pytest.raises(MergeError, match="different splits"):
        merge_shards([s0, _shard_summary(tmp_path / "o", "1/2", ["z"])], tmp_path / "x")
    with pytest.raises(MergeError, match="cannot read batch summary"):
        merge_shards([tmp_path / "missing"], tmp_path / "x")


def test_progress_rich_on_terminals_plain_lines_otherwise() -> None:
    from rich.console import Console

    from amplite.batch.progress import PlainProgress, RichProgress, make_progress

    assert isinstance(make_progress(True), PlainProgress)  # pytest's stdout is not a terminal
    buf = io.StringIO()
    progress = RichProgress(Console(file=buf, force_terminal=True, width=120))
    progress.start(2)
    progress.started("bert")
    progress.finished({**failure_row({"name": "bert"}, "ok", None), "seconds": 1.5})
    progress.finished({**failure_row({"name": "[gpt]"}, "timeout", "timed out after 5 s"), "seconds": 5.0})
    progress.close()
    text = buf.getvalue()
    assert "bert" in text and "[gpt]" in text and "timed out after 5 s" in text and "2/2" in text


def test_default_workers_respects_cpus_memory_and_job_count(tmp_path: Path, monkeypatch) -> None:
    from amplite.batch import runner

    model = tmp_path / "m.pt2"
    model.write_bytes(b"x" * 1000)
    jobs = [Job.from_dict({"name": f"m{i}", "path": str(model)}) for i in range(8)]
    monkeypatch.setattr(runner, "cpu_count", lambda: 4)
    monkeypatch.setattr(runner, "available_memory", lambda: 64 * 2**30)
    assert runner.default_workers(jobs) == 4 and runner.default_workers(jobs[:2]) == 2
    monkeypatch.setattr(runner, "available_memory", lambda: 5 * 2**30)  # 2 GiB per conversion at least
    assert runner.default_workers(jobs) == 2
    monkeypatch.setattr(runner, "available_memory", lambda: 2**29)
    assert runner.default_workers(jobs) == 1


def test_cli_options_are_defaults_the_manifest_overrides(tmp_path: Path, monkeypatch) -> None:
    from amplite.batch import defaults_from_options

    monkeypatch.chdir(tmp_path)
    from amplite import ConvertOptions

    given = ConvertOptions.of(precision="bf16", keep_fp32=["op:mm*"], verify=False)
    opts = defaults_from_options(given, inputs_file="in.pt")
    assert opts == {"precision": "bf16", "inputs_file": str(tmp_path / "in.pt"), "keep_fp32": ["op:mm*"],
                    "verify": False}  # fmt: skip
    sub = tmp_path / "zoo"
    sub.mkdir()
    p = _manifest(
        sub,
        '[[model]]\nname = "a"\npath = "m.pt2"\n\n[[model]]\nname = "b"\npath = "m.pt2"\nprecision = "fp16"\n',
    )
    a, b = load_jobs(p, opts)
    assert (a.options.precision, b.options.precision) == ("bf16", "fp16")
    assert a.inputs_file == str(tmp_path / "in.pt")  # relative to where the command ran, not the manifest
    assert a.options.verify is False and a.options.keep_fp32 == ("op:mm*",)
