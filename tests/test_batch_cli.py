"""`amplite batch` on the command line: plain progress lines and error hints printed as written."""

from __future__ import annotations

import json
from pathlib import Path


def test_no_progress_prints_plain_lines(cli, tmp_path: Path) -> None:
    manifest = tmp_path / "zoo.toml"
    manifest.write_text('[[model]]\nname = "gone"\npath = "missing.pt2"\n')
    res = cli("batch", manifest, "-o", tmp_path / "out", "--no-progress")
    assert res.exit_code == 1, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "amplite batch: 1 model(s)"
    assert lines[1].startswith("[1/1] error") and "gone" in lines[1] and "does not exist" in lines[1]
    assert lines[2].startswith("done: 1/1")


def test_error_hints_keep_bracketed_text(cli, tmp_path: Path) -> None:
    """rich reads `[[model]]` and `[defaults]` as markup; users must see them."""
    dup = tmp_path / "dup.toml"
    dup.write_text('[[model]]\nname = "m"\npath = "a.pt2"\n[[model]]\nname = "m"\npath = "b.pt2"\n')
    res = cli("batch", dup, "-o", tmp_path / "out")
    assert res.exit_code == 2
    assert 'give each [[model]] a unique name = "..."' in " ".join(res.stderr.split()), res.stderr
    per_model = tmp_path / "defaults.toml"
    per_model.write_text('[defaults]\npath = "a.pt2"\n[[model]]\nname = "m"\npath = "a.pt2"\n')
    res = cli("batch", per_model, "-o", tmp_path / "out")
    assert res.exit_code == 2 and "move it into a [[model]] entry" in " ".join(res.stderr.split()), res.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[defaults]\nlevl = "O2"\n[[model]]\npath = "a.pt2"\n')
    res = cli("batch", bad, "-o", tmp_path / "out")
    joined = " ".join(res.stderr.split())
    assert "unknown key 'levl'" in res.stderr and "did you mean 'level'?" in joined and "(see docs/batch.md)" in joined


def test_summary_line_keeps_brackets_in_paths(cli, tmp_path: Path) -> None:
    manifest = tmp_path / "zoo.toml"
    manifest.write_text('[[model]]\nname = "gone"\npath = "missing.pt2"\n')
    out = tmp_path / "[dev] run"
    res = cli("batch", manifest, "-o", out, "--no-progress")
    assert res.exit_code == 1
    assert f"summary: {out / 'summary.md'}" in res.stdout, res.stdout
    assert json.loads((out / "summary.json").read_text())["counts"] == {"error": 1}


def test_convert_prints_bracketed_paths_as_written(cli, model_files, tmp_path: Path) -> None:
    """The same escaping holds for every command's rich output (here: convert's table and file lines)."""
    import shutil

    d = tmp_path / "[dev]"
    d.mkdir()
    model = shutil.copy(model_files("mlp")["pt2"], d / "mlp.pt2")
    res = cli("convert", model, "-o", d / "m.pt2")
    assert res.exit_code == 0, res.stderr
    text = res.stdout
    assert f"wrote {d / 'm.pt2'}" in text and f"report {d / 'm.report.json'}" in text, text
