"""Issue 45: what amplite writes is as safe as what it reads. Every hostile file, link, FIFO or socket (the
stand-in for a device: creating a device node needs privileges) is built here, inside a temp folder.

Refusals are checked as in ``test_security_io``: exit 2, one line, no traceback, bounded time (the CLI runs
in fresh interpreters under a 3 GiB address-space limit), and nothing written, replaced or followed.
The CLI calls of most tests run in ONE interpreter (the module fixture ``runs``).
"""

from __future__ import annotations

import io
import json
import os
import resource
import socket
import stat
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_security_io import Small, assert_refused, run_many, run_one

EVIL_NAME = "<img src=x onerror=alert(1)><a href=http://evil_x>click</a><b>bold</b>[l](http://evil_x)\x1b[2K\x1b[32mPASS\x1b[0m\tTAB\x01\x0b"
EVIL_KEY = "<a href=http://evil.example>click</a>|**b** [l](http://evil.example)"  # no quote: a pt2 refuses it
EVIL_FILE = "m\x1b]8;;http:evil\x07hid\x1b[2K\t<img src=x onerror=alert(1)>[l](http:evil)\x01.pt2"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "m.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(Small().eval(), (torch.randn(2, 4),)), str(path))
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # the file stays after close: a socket node, as /dev/log is
    s.close()
    return path


def _state(d: Path) -> dict[str, Any]:
    """Every entry under ``d``: a file's bytes, a link's target, or the kind of a special file."""
    out: dict[str, Any] = {}
    for p in sorted(d.rglob("*")):
        mode = os.lstat(p).st_mode
        key = str(p.relative_to(d))
        out[key] = ("link", os.readlink(p)) if stat.S_ISLNK(mode) else p.read_bytes() if stat.S_ISREG(mode) else (
            "dir" if stat.S_ISDIR(mode) else ("special", stat.S_IFMT(mode)))  # fmt: skip
    return out


def _replace_entry(src: Path, dest: Path, suffix: str, edit: Any) -> Path:
    """A copy of the archive ``src`` whose entry ending in ``suffix`` is ``edit(old bytes)``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, edit(data) if item.filename.endswith(suffix) else data)
    return dest


class Dyn(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


class Keyed(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {EVIL_KEY: torch.relu(x) * 2}


def _outputs(model: Path, d: Path) -> tuple[list[list[object]], Any]:
    outside = d / "outside"
    outside.mkdir()
    (outside / "victim.pt2").write_bytes(b"the user's file")
    (outside / "dir").mkdir()
    (outside / "dir" / "keep.txt").write_text("keep")
    w = d / "w"
    w.mkdir()
    (w / "link.pt2").symlink_to(outside / "victim.pt2")
    (w / "link.xml").symlink_to(outside / "victim.pt2")
    _fifo(w / "fifo.json")
    _socket(w / "sock.json")
    (w / "rep").mkdir()
    (w / "rep" / "report.md").symlink_to(outside / "victim.pt2")
    (w / "gold").symlink_to(outside / "dir")
    calls = [
        ["convert", model, "-o", w / "link.pt2"],
        ["convert", model, "-o", w / "a.pt2", "--report", w / "fifo.json"],
        ["convert", model, "-o", w / "b.pt2", "--report", w / "sock.json"],
        ["check", model, "--junit", w / "link.xml"],
        ["check", model, "--report", w / "rep"],
        ["golden", model, "-o", w / "gold", "--update-golden"],
        ["convert", model, "-o", d / "c.pt2", "--report", "-"],
        ["check", model, "--junit", "-"],
    ]
    return calls, (w, outside, _state(d))


def _batch(model: Path, d: Path) -> tuple[list[list[object]], Any]:
    manifest = d / "zoo.toml"
    manifest.write_text('[[model]]\nname = "gone"\npath = "missing.pt2"\n')
    (d / "out").mkdir()
    (d / "out" / "summary.json").write_text('{"mine": "the user\'s own summary"}')
    row = {"name": "a", "status": "ok", "output_dir": "a"}
    docs = {"good": {"models": [row]}, "huge_split": {"models": [row], "shard": "0/999999999"},
            "dict_status": {"models": [{**row, "status": {"x": 1}}]},
            "list_params": {"models": [{**row, "params": [1]}]}}  # fmt: skip
    for name, doc in docs.items():
        (d / name).mkdir()
        (d / name / "summary.json").write_text(json.dumps({"schema": "amplite.batch_summary", **doc}))
    (d / "merged").mkdir()
    (d / "merged" / "summary.md").write_text("my notes")
    fifo_zoo = d / "fifo.toml"
    _fifo(d / "fifo_model.pt2")
    fifo_zoo.write_text('[[model]]\nname = "f"\npath = "fifo_model.pt2"\n')
    calls = [
        ["batch", manifest, "-o", d / "out", "--no-progress"],
        ["batch", "merge", d / "good", "-o", d / "merged"],
        ["batch", "merge", d / "huge_split", "-o", d / "m1"],
        ["batch", "merge", d / "dict_status", "-o", d / "m2"],
        ["batch", "merge", d / "list_params", "-o", d / "m3"],
        ["batch", fifo_zoo, "-o", d / "fifo_out", "--no-progress"],
    ]
    return calls, _state(d)


def _inputs(model: Path, d: Path) -> tuple[list[list[object]], Any]:
    """Exit 3 where the input is at fault (item 5), and inputs that are not files (item 7)."""
    b = torch.export.Dim("b", min=1, max=64)
    dyn = d / "dyn.pt2"
    torch.export.save(torch.export.export(Dyn(), (torch.randn(4, 3),), dynamic_shapes=({0: b},)), str(dyn))

    def no_ranges(data: bytes) -> bytes:
        doc = json.loads(data)
        assert doc["range_constraints"]
        return json.dumps({**doc, "range_constraints": {}}).encode()

    def int_key(data: bytes) -> bytes:
        buf = io.BytesIO()
        torch.save(((), {3: torch.randn(2, 4)}), buf)
        return buf.getvalue()

    _replace_entry(dyn, d / "no_range.pt2", "models/model.json", no_ranges)
    _replace_entry(model, d / "int_key.pt2", "sample_inputs/model.pt", int_key)
    calls = [
        ["check", model, "--random-batches", 1_000_000_000, "--input", "x:2x4:float32"],
        ["convert", model, "--input", "x:200000x200000:float32", "-o", d / "big.pt2"],
        ["convert", model, "--input", f"x:{'9' * 5000}x4:float32", "-o", d / "digits.pt2"],
        ["convert", d / "no_range.pt2", "--input", "x:4x3:float32", "-o", d / "nr.pt2"],
        ["convert", d / "int_key.pt2", "-o", d / "ik.pt2"],
        ["convert", _fifo(d / "fifo.pt2"), "-o", d / "f.pt2"],
        ["convert", _socket(d / "sock.pt2"), "-o", d / "s.pt2"],
        ["convert", model, "--inputs", _fifo(d / "x.pt"), "-o", d / "i.pt2"],
        ["batch", _fifo(d / "zoo.toml"), "-o", d / "zoo"],
        ["check", model, "--baseline", _fifo(d / "base.json")],
    ]
    return calls, None


def _reads(model: Path, d: Path) -> tuple[list[list[object]], Any]:
    """Item 4: files of a directory the user named never lead out of it."""
    from amplite.gate import make_golden

    secret = d / "secret"
    secret.mkdir()
    torch.save(torch.randn(2, 4), secret / "x.pt")
    data = d / "data"
    data.mkdir()
    torch.save(torch.randn(2, 4), data / "a.pt")
    (data / "b.pt").symlink_to(secret / "x.pt")
    fifo_data = d / "fifo_data"
    fifo_data.mkdir()
    torch.save(torch.randn(2, 4), fifo_data / "a.pt")
    _fifo(fifo_data / "b.pt")
    gold = make_golden(model, (torch.randn(2, 4),), output=d / "gold")
    other = make_golden(model, (torch.randn(2, 4),), output=secret / "gold")
    (gold / "golden.json").unlink()
    (gold / "golden.json").symlink_to(other / "golden.json")
    calls = [
        ["check", model, "--data", data],
        ["convert", model, "--calib", data, "--range-rules", "-o", d / "c.pt2"],
        ["check", model, "--golden", gold],
        ["check", model, "--data", fifo_data],
    ]
    return calls, None


def _escapes(model: Path, d: Path) -> tuple[list[list[object]], Any]:
    """Item 6: names from the model files in every medium."""
    keyed = d / EVIL_FILE
    torch.export.save(torch.export.export(Keyed().eval(), (torch.randn(2, 4),)), str(keyed))
    seq = torch.nn.Sequential()
    seq.add_module(EVIL_NAME, torch.nn.Linear(4, 3))  # torch.save'd modules may name children freely
    seq.add_module("act", torch.nn.ReLU())
    pickled = d / EVIL_FILE.replace(".pt2", ".pt")
    torch.save(seq, pickled)
    calls = [
        ["check", keyed, "--report", d / "keyed", "--junit", d / "keyed.xml"],
        ["check", pickled, "--trust-pickle", "--input", "input:2x4:float32", "--report", d / "seq",
         "--junit", d / "seq.xml"],
        ["inspect", pickled, "--trust-pickle", "--input", "input:2x4:float32"],
        ["convert", pickled, "--trust-pickle", "--input", "input:2x4:float32", "-o", d / "seq.pt2"],
    ]
    return calls, None


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("writes")
    setups = {"outputs": _outputs, "batch": _batch, "inputs": _inputs, "reads": _reads, "escapes": _escapes}
    calls: list[list[object]] = []
    spans, context = {}, {}
    for key, setup in setups.items():
        folder = root / key
        folder.mkdir()
        mine, extra = setup(model, folder)
        spans[key] = (len(calls), len(calls) + len(mine))
        calls += mine
        context[key] = (folder, extra)
    results = run_many(calls, root, timeout=400)
    return {k: (*context[k], results[a:b]) for k, (a, b) in spans.items()}


def test_outputs_never_follow_or_replace_links_devices_or_fifos(runs: dict) -> None:
    d, (_, _, before), results = runs["outputs"]
    *refusals, stdout_run, junit_run = results
    needles = ["is a symbolic link", "is a FIFO", "is a socket", "is a symbolic link", "is a symbolic link",
               "is a symbolic link"]  # fmt: skip
    for res, needle in zip(refusals, needles, strict=True):
        assert_refused(res, needle, "fix:")
    after = _state(d)
    assert {k: v for k, v in after.items() if k in before} == before, "a refused run changed a file or a link"
    new = set(after) - set(before)
    assert new == {"c.pt2"}, new  # only what `--report -` wrote; no report.json in w/rep, no a.pt2, no b.pt2
    assert stdout_run["rc"] == 0, stdout_run["err"][-2000:]
    report = json.loads(stdout_run["out"])  # --report -: the JSON report alone on stdout
    assert report["schema"] == "amplite.report" and report["outputs"][0]["path"].endswith("c.pt2")
    assert "amplite fp16 O1" in stdout_run["err"]  # the summary went to stderr
    assert junit_run["rc"] == 0, junit_run["err"][-2000:]
    suite = ET.fromstring(junit_run["out"])  # --junit -: the XML alone on stdout, the verdict table on stderr
    assert suite.tag == "testsuites" and "amplite check: PASS" in junit_run["err"]


def test_batch_never_overwrites_files_it_did_not_write_and_merge_checks_rows(runs: dict) -> None:
    d, before, results = runs["batch"]
    assert_refused(results[0], "summary.json", "amplite did not write it")
    assert_refused(results[1], "summary.md", "amplite did not write it")
    assert_refused(results[2], "shard(s) 1/999999999, 2/999999999", "more missing", max_seconds=5)
    assert_refused(results[3], "'status' is not one of")
    assert_refused(results[4], "'params' is a list")
    after = _state(d)
    assert {k: v for k, v in after.items() if k in before} == before
    fifo_run = results[5]
    assert fifo_run["rc"] == 1, fifo_run
    row = json.loads((d / "fifo_out" / "summary.json").read_text())["models"][0]
    assert row["status"] == "error" and "is a FIFO (named pipe)" in row["error"], row
    assert "does not exist" not in row["error"]


def test_input_faults_are_exit_2_not_internal_errors(runs: dict) -> None:
    d, _, results = runs["inputs"]
    needles = ["is more than --max-batches 64", "GiB, more than the 16 GiB", "bad shape",
               "which has no range constraint", "with string keywords", "is a FIFO (named pipe)", "is a socket",
               "is a FIFO (named pipe)", "is a FIFO (named pipe)", "is a FIFO (named pipe)"]  # fmt: skip
    for res, needle in zip(results, needles, strict=True):
        assert_refused(res, needle, max_seconds=15)
        assert "does not exist" not in res["err"]
    assert not list(d.glob("[bdnifs]*.pt2.*")) and not (d / "big.pt2").exists() and not (d / "zoo").exists()


def test_files_of_a_named_directory_never_lead_outside_it(runs: dict) -> None:
    d, _, results = runs["reads"]
    for res in results[:3]:
        assert_refused(res, "is a symlink", "amplite reads only files inside")
    assert_refused(results[3], "is a FIFO (named pipe)")
    assert not (d / "c.pt2").exists()


def test_checkpoint_output_directory_that_is_a_link_is_refused_and_overlapping_offsets_too(tmp_path: Path) -> None:
    from amplite.errors import AmpliteError
    from amplite.save import convert_to_files
    from bench.checkpoint_archs import make_checkpoint

    ckpt = make_checkpoint("llama", tmp_path / "src")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(AmpliteError, match="is a symbolic link") as info:
        convert_to_files(ckpt, output=tmp_path / "link", formats="safetensors", verify=False)
    assert info.value.exit_code == 2 and list((tmp_path / "elsewhere").iterdir()) == []
    assert (tmp_path / "link").is_symlink()
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    names = [n for n in header if n != "__metadata__"]
    first = min(names, key=lambda n: header[n]["data_offsets"][0])
    twin = next(n for n in names if n != first)
    start, end = header[twin]["data_offsets"]
    at = header[first]["data_offsets"][0]
    header[twin]["data_offsets"] = [at, at + end - start]  # its size still fits its shape: it overlaps `first`
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text)) if len(text) <= size else b""
    assert len(text) == size
    shard.write_bytes(raw[:8] + text + raw[8 + size :])
    with pytest.raises(AmpliteError, match="overlaps another") as info:
        convert_to_files(ckpt, output=tmp_path / "out", formats="safetensors", verify=False)
    assert info.value.exit_code == 2 and not (tmp_path / "out").exists()


def _controls(text: str) -> list[str]:
    return sorted({c for c in text if (ord(c) < 32 and c not in "\n") or 0x7F <= ord(c) <= 0x9F})


def test_names_from_model_files_are_escaped_in_every_medium(runs: dict) -> None:
    from markdown_it import MarkdownIt

    d, _, results = runs["escapes"]
    for res in results:
        assert res["rc"] == 0, res["err"][-2000:]
    # terminal: no ESC, BEL, CR or other control character reaches it; the escapes are shown as text
    for res in (results[0], results[1], results[3]):
        assert _controls(res["out"] + res["err"]) == [], res["out"]
    assert "\\x1b[2K" in results[1]["out"]
    # inspect: tab-separated rows of exactly five fields
    rows = results[2]["out"].splitlines()[:-1]
    assert len(rows) == 3 and all(r.count("\t") == 4 for r in rows), rows
    assert _controls(results[2]["out"].replace("\t", "")) == [] and "\\t" in rows[1]
    for name in ("keyed", "seq"):
        md = (d / name / "report.md").read_text()
        rendered = MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
        assert "<img" not in rendered and "<a " not in rendered and "<strong>b" not in rendered, rendered
        assert _controls(md) == []
        junit = (d / f"{name}.xml").read_text()
        ET.fromstring(junit)  # control characters would make it invalid XML
        html = (d / name / "report.html").read_text()
        assert "<img src=x" not in html and "<a href=http://evil" not in html and "\x1b" not in html
    cases = [c.get("name") for c in ET.parse(d / "keyed.xml").getroot().iter("testcase")]
    assert cases == [f"output[{EVIL_KEY!r}]"]


@pytest.mark.skipif(not __import__("tests.test_html_report", fromlist=["CHROMIUM"]).CHROMIUM,
                    reason="no Chromium binary (apt-get install chromium)")  # fmt: skip
def test_html_report_with_hostile_names_renders_no_link_or_image(runs: dict, tmp_path: Path) -> None:
    from tests.test_html_report import Browser

    d, _, _ = runs["escapes"]
    browser = Browser(tmp_path / "profile")
    try:
        for name in ("keyed", "seq"):
            session, errors = browser.load(d / name / "report.html")
            assert errors == [], errors[:3]
            found = browser.evaluate(session, """(() => ({
                links: document.querySelectorAll('a[href], a[*|href], .xtick a, .ytick a, .gtitle a').length,
                images: document.querySelectorAll('img, image').length,
                bold: Array.from(document.querySelectorAll('.xtick text, .ytick text')).filter(
                    t => t.querySelector('tspan[style*="bold"], a')).length,
                ticks: Array.from(document.querySelectorAll('.xtick text')).map(t => t.textContent)}))()""")
            assert found["links"] == 0 and found["images"] == 0 and found["bold"] == 0, found
            if name == "seq":  # the layer chart's axis shows the module name as text
                assert any("<img src=x" in t for t in found["ticks"]), found["ticks"]
    finally:
        browser.close()


def test_migrate_skips_fifos_huge_and_slow_files_and_migrates_the_rest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _fifo(src / "a_fifo.py")
    (src / "b_huge.py").write_text("x = 1\n" * 1_750_000)  # 10 MB: libcst aborted the process
    (src / "c_slow.py").write_text("x = 1\n" * 170_000)  # 1 MB: still running after 600 s
    good = "import torch\nwith torch.cuda.amp.autocast():\n    pass\n"
    (src / "d_good.py").write_text(good)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_one(["migrate", src, "--file-timeout", "3"], tmp_path, timeout=240)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the CLI and its (waited-for) migrate child
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    out = proc.stdout
    assert f"skipped {src / 'a_fifo.py'}: not read: it is a FIFO (named pipe)" in out, out
    assert f"skipped {src / 'b_huge.py'}: not parsed: 10,500,000 bytes" in out, out
    # killed after 3 s (or, under the 3 GiB limit, out of memory in its child): skipped either way, the run goes on
    assert f"skipped {src / 'c_slow.py'}: " in out and "nests too deeply" not in out, out
    assert f"rewrote {src / 'd_good.py'}" in out and "torch.amp.autocast" in (src / "d_good.py").read_text()
    assert (src / "b_huge.py").stat().st_size == 10_500_000 and stat.S_ISFIFO(os.lstat(src / "a_fifo.py").st_mode)
    # CPU seconds, not wall time (the 2-core CI machine is shared): ~10 s here, where the 1 MB file alone ran
    # for more than 600 s before; 40 s leaves room for torch's import on a slow machine
    assert cpu < 40, cpu
    alone = run_one(["migrate", src / "a_fifo.py"], tmp_path, timeout=60)
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1 and "is a FIFO" in alone.stderr, alone.stderr


def test_each_escaper_keeps_text_inert_in_its_medium() -> None:
    from markdown_it import MarkdownIt

    from amplite import escape

    hostile = "<img src=x>[l](http://e.x) **b** `c` | www.e.x \x1b[2K\r\t\n\x01\x9b\u202e\udcff"
    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    for text in (escape.markdown(hostile), escape.markdown_code(hostile), escape.markdown_code("`a``")):
        rendered = md.render(f"| a |\n|---|\n| {text} |\n")
        assert "<img" not in rendered and "<a " not in rendered and "<strong>" not in rendered, rendered
        assert rendered.count("<td>") == 1 and "\n" not in text and "\x1b" not in text
    assert md.render(escape.markdown_code("`a``")).strip() == "<p><code>`a``</code></p>"
    assert escape.terminal(hostile) == ("<img src=x>[l](http://e.x) **b** `c` | www.e.x \\x1b[2K\\x0d\t\\x0a\\x01\\x9b"
                                        "\\u202e\\udcff")  # fmt: skip
    assert escape.terminal("a\nb", newlines=True) == "a\nb"
    assert escape.tsv("a\tb\nc\\") == "a\\tb\\nc\\\\"
    assert "<" not in escape.html(hostile) and "\x1b" not in escape.html(hostile) and "\t\n" in escape.html(hostile)
    el = ET.Element("case", name=escape.xml(hostile))
    el.text = escape.xml(hostile)
    back = ET.fromstring(ET.tostring(el, encoding="unicode").encode())  # raw, \x01 would make it invalid XML
    assert back.text is not None and "\\x01" in back.text and "\\udcff" in back.get("name")
