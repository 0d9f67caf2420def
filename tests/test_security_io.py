"""Issue 27, cases 10-14: hostile input files, outputs that overwrite inputs, migrate on hostile sources,
malformed user data, and what a manifest may do. Every hostile input is built here, small.

The CLI runs in a fresh process under a 3 GiB address-space limit (``RLIMIT_AS``). To keep the file fast on a
loaded machine, :func:`run_many` starts one interpreter for many CLI calls (each call's stdout, stderr,
exit code and seconds come back as JSON; the five refusal tests share one, the module fixture ``batched``);
a run that can crash the interpreter (migrate) gets its own.
Every refusal must be: exit 2, exactly one line on stderr, no traceback, no warning, nothing written.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests import fresh

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 3 << 30

_DRIVER = r"""
import contextlib, io, json, sys, time, warnings
warnings.simplefilter("always")  # a warning is shown every time, so a test sees it in every call
from amplite.cli import app
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(args=argv, prog_name="amplite")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    results.append({"rc": code, "out": out.getvalue(), "err": err.getvalue(),
                    "seconds": time.perf_counter() - start})
print("@@RESULTS@@" + json.dumps(results))
"""


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def run_many(calls: list[list[object]], cwd: Path, timeout: float = 240) -> list[dict]:
    """Run several ``amplite`` CLI calls in one fresh, memory-limited interpreter."""
    argv = json.dumps([[str(a) for a in call] for call in calls])
    proc = fresh.run([sys.executable, "-c", _DRIVER, argv], env=_env(), cwd=cwd, timeout=timeout,
                     rlimits={resource.RLIMIT_AS: MEMORY_LIMIT})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("@@RESULTS@@", 1)[1])


def run_one(args: list[object], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """One ``python -m amplite`` process (for runs that could kill the interpreter)."""
    return fresh.run([sys.executable, "-m", "amplite", *map(str, args)], env=_env(), cwd=cwd, timeout=timeout,
                     rlimits={resource.RLIMIT_AS: MEMORY_LIMIT})  # fmt: skip


def assert_refused(res: dict, *needles: str, max_seconds: float = 20.0) -> None:
    """Exit 2, one line on stderr (no traceback, no warning before it), in bounded time."""
    err = res["err"]
    assert res["rc"] == 2, res
    assert err.count("\n") == 1 and err.startswith("error:"), err
    assert "Traceback" not in err and "Warning" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert res["seconds"] < max_seconds, res


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "m.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(Small().eval(), (torch.randn(2, 4),)), str(path))
    return path


@pytest.fixture(scope="module")
def batched(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The CLI calls of the five refusal tests below, each test's files in its own folder, all run in ONE
    fresh memory-limited interpreter (:func:`run_many`: one start-up instead of five). By test key:
    (folder, what the test needs of its set-up, its calls' results); ``"calls"``: the calls by key."""
    root = tmp_path_factory.mktemp("batched")
    setups = {"hostile": _hostile_calls, "outputs": _outputs_calls, "defaults": _defaults_calls,
              "batch": _batch_calls, "golden": _golden_calls}  # fmt: skip
    calls: list[list[object]] = []
    spans, context, by_key = {}, {}, {}
    for key, setup in setups.items():
        folder = root / key
        folder.mkdir()
        mine, extra = setup(model, folder)
        spans[key] = (len(calls), len(calls) + len(mine))
        calls += mine
        context[key] = (folder, extra)
        by_key[key] = mine
    results = run_many(calls, root)
    out: dict[str, Any] = {k: (*context[k], results[a:b]) for k, (a, b) in spans.items()}
    return {**out, "calls": by_key}


def _npy(descr: str, shape: tuple[int, ...], data: bytes = b"") -> bytes:
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data


def _npz(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def hostile_inputs(d: Path) -> dict[str, Path]:
    """Case 10 and the input-file part of case 13: small files that hang, allocate GBs or crash parsers."""
    d.mkdir(exist_ok=True)
    files = {
        "void_1e18": _npz(d / "v0.npz", {"arr_0.npy": _npy("|V0", (10**9, 10**9))}),
        "object": _npz(d / "obj.npz", {"arr_0.npy": _npy("|O", (2,), b"\0" * 16)}),
        "claims_more": _npz(d / "big.npz", {"arr_0.npy": _npy("<f4", (10**6, 10**3), b"\0" * 16)}),
        "structured": _npz(d / "rec.npz", {"arr_0.npy": _npy("[('a', '<f4')]", (1,), b"\0" * 4)}),
        "bad_header": _npz(d / "hdr.npz", {"arr_0.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': ((((\n"}),
    }
    assert files["void_1e18"].stat().st_size < 300
    torch.save(torch.zeros(4).expand(300_000_000, 4), d / "expand.pt")
    files["expand"] = d / "expand.pt"
    assert files["expand"].stat().st_size < 2000
    torch.save(torch.zeros(20_007).as_strided((20_000, 8), (1, 1)), d / "overlap.pt")  # rows overlap
    files["overlap"] = d / "overlap.pt"
    torch.save({3: torch.ones(2, 4)}, d / "intkey.pt")
    files["int_key"] = d / "intkey.pt"
    good = d / "good.pt"
    torch.save(torch.ones(2, 4), good)
    raw = bytearray(good.read_bytes())  # corrupt a zip field torch's miniz reader checks (a RuntimeError)
    at = raw.find(b"PK\x03\x04", 1)
    raw[at + 26 : at + 28] = b"\xff\xff"  # the second local header's name length: miniz's RuntimeError
    (d / "crc.pt").write_bytes(bytes(raw))
    files["miniz_crc"] = d / "crc.pt"
    nested: object = torch.ones(1)
    for _ in range(100):
        nested = [nested]
    torch.save(nested, d / "deep.pt")
    files["deep"] = d / "deep.pt"
    return files


def _hostile_calls(model: Path, tmp_path: Path) -> tuple[list[list[object]], Any]:
    files = hostile_inputs(tmp_path / "in")
    names = list(files)
    calls = [["convert", model, "--inputs", files[n], "-o", tmp_path / f"{n}.pt2"] for n in names]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "a.pt").write_bytes(files["expand"].read_bytes())
    calls.append(["check", model, "--data", data_dir, "--report", tmp_path / "rep"])
    calls.append(["convert", model, "--calib", data_dir, "-o", tmp_path / "calib.pt2"])
    return calls, names


def test_hostile_input_files_are_refused_in_bounded_time_and_memory(batched: dict) -> None:
    tmp_path, names, results = batched["hostile"]
    for name, res in zip([*names, "data", "calib"], results, strict=True):
        assert_refused(res, "inputs file", max_seconds=15)
        assert "amplite bug" not in res["err"], name
    assert "'|V0'" in results[0]["err"] and "expanded or overlapping view" in results[names.index("expand")]["err"]
    assert "a key is a int" in results[names.index("int_key")]["err"]
    assert not list(tmp_path.glob("*.pt2")) and not (tmp_path / "rep").exists()


def test_benign_input_files_still_load(tmp_path: Path) -> None:
    from amplite.converter.inputs import load_inputs_file

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.savez(tmp_path / "a.npz", x, np.asfortranarray(x))
    np.savez_compressed(tmp_path / "c.npz", ids=np.arange(6, dtype=np.int64), mask=np.ones(6, bool))
    torch.save({"x": torch.arange(10.0)[2:6].reshape(2, 2), "y": torch.ones(4, 3).t()}, tmp_path / "d.pt")
    args, _ = load_inputs_file(tmp_path / "a.npz")
    assert torch.equal(args[0], torch.from_numpy(x)) and torch.equal(args[1], torch.from_numpy(x))
    _, kw = load_inputs_file(tmp_path / "c.npz")
    assert kw["ids"].dtype == torch.int64 and kw["mask"].dtype == torch.bool and kw["ids"].tolist() == list(range(6))
    _, kw = load_inputs_file(tmp_path / "d.pt")
    assert kw["x"].tolist() == [[2.0, 3.0], [4.0, 5.0]] and kw["y"].shape == (3, 4)


def _digest(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _outputs_calls(model: Path, tmp_path: Path) -> tuple[list[list[object]], Any]:
    d = tmp_path / "w"
    d.mkdir()
    m = d / "m.pt2"
    m.write_bytes(model.read_bytes())
    (d / "m.fp16.O1.pt2").write_bytes(model.read_bytes())  # converting it: its default name is itself
    (d / "v2.pt2").write_bytes(model.read_bytes())
    (d / "v2.fp16.O1.pt2").write_bytes(b"unrelated file amplite did not write")
    os.link(m, d / "hard.pt2")
    (d / "soft.pt2").symlink_to(m)
    torch.save(torch.randn(2, 4), d / "x.pt")
    zoo = d / "zoo"
    (zoo / "m").mkdir(parents=True)
    (zoo / "m.pt2").write_bytes(model.read_bytes())
    (zoo / "m" / "important.txt").write_text("keep me")
    before = _digest(d)
    calls = [
        ["convert", m, "-o", m],
        ["convert", m, "-o", d / "out.pt2", "--report", m],
        ["convert", m, "-o", d / "out.pt2", "--report", d / "out.pt2"],
        ["convert", m, "-o", d / "hard.pt2"],
        ["convert", m, "-o", d / "soft.pt2"],
        ["convert", m, "--inputs", d / "x.pt", "-o", d / "o.pt2", "--report", d / "x.pt"],
        ["convert", d / "m.fp16.O1.pt2"],
        ["convert", d / "v2.pt2"],
        ["check", m, "--junit", m],
        ["check", m, "--report", d / "r", "--junit", d / "r" / "report.json"],
        ["golden", m, "-o", d],
        ["batch", zoo, "-o", zoo],
        ["batch", zoo, "-o", d / "zoo" / "m.pt2"],
    ]
    return calls, (d, before)


def test_outputs_never_overwrite_inputs_or_each_other(batched: dict) -> None:
    _, (d, before), results = batched["outputs"]
    calls = batched["calls"]["outputs"]
    # -o a symlink to the model: refused as a link (amplite never writes through or replaces one, issue 45)
    expected = ["is the model", "is the model", "the same path", "is the model", "is a symbolic link",
                "is the --inputs file", "is the model", "amplite did not write", "is the model", "the same path",
                "holds the model", "not written by amplite", "is the model"]  # fmt: skip
    for call, res, needle in zip(calls, results, expected, strict=True):
        assert_refused(res, needle)
        assert "fix:" in res["err"], call
    assert _digest(d) == before, "a refused run wrote, changed or deleted a file"
    assert not (d / "out.pt2").exists() and not list(d.glob("*.report.json"))


def _defaults_calls(model: Path, tmp_path: Path) -> tuple[list[list[object]], Any]:
    m = tmp_path / "m.pt2"
    m.write_bytes(model.read_bytes())
    return [["convert", m, "--no-verify"], ["convert", m, "--no-verify"]], m


def test_default_names_are_reused_only_for_amplite_s_own_output(batched: dict) -> None:
    tmp_path, m, (first, again) = batched["defaults"]
    assert first["rc"] == 0 and again["rc"] == 0, (first, again)  # re-running replaces amplite's own output
    assert (tmp_path / "m.fp16.O1.pt2").is_file() and (tmp_path / "m.fp16.O1.report.json").is_file()
    (tmp_path / "m.fp16.O1.report.json").unlink()  # now nothing says amplite wrote m.fp16.O1.pt2
    from amplite.errors import ConfigError
    from amplite.save import convert_to_files

    before = (tmp_path / "m.fp16.O1.pt2").read_bytes()
    with pytest.raises(ConfigError, match=r"default output .*m\.fp16\.O1\.pt2' already exists .* pass -o"):
        convert_to_files(m, verify=False)  # refused before any work: in-process is enough
    assert (tmp_path / "m.fp16.O1.pt2").read_bytes() == before and not (tmp_path / "m.fp16.O1.report.json").exists()


AMP = "import torch\nfrom torch.cuda import amp\n\nwith amp.autocast():  # fwd\n    y = model(x)\n"
AMP_MIGRATED = 'import torch\n\nwith torch.amp.autocast("cuda"):  # fwd\n    y = model(x)\n'
DEEP = {  # each crashed (SIGSEGV), hung or raised RecursionError inside libcst
    "brackets.py": "x = " + "(" * 2000 + "1" + ")" * 2000 + "\n",
    "lists.py": "x = " + "[" * 2000 + "]" * 2000 + "\n",
    "unary.py": "x = " + "-" * 20000 + "1\n",
    "binop.py": "x = " + "1+" * 5000 + "1\n",
    "attrs.py": "x = a" + ".b" * 1000 + "\n",
    "ifexp.py": "x = " + "1 if a else " * 400 + "1\n",
}


def test_migrate_single_deep_file_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "deep.py"
    text = 'p = "\\d"\n' + DEEP["brackets.py"]  # an invalid escape: CPython's SyntaxWarning must not print
    path.write_text(text)
    assert path.stat().st_size < 4200
    start = time.perf_counter()
    res = run_one(["migrate", path], tmp_path)
    assert_refused({"rc": res.returncode, "err": res.stderr, "seconds": time.perf_counter() - start},
                   "deep.py", "too many nested parentheses", max_seconds=60)  # fmt: skip
    assert path.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["deep.py"]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_migrate_directory_skips_deep_files_and_symlinks_out_and_migrates_the_rest(tmp_path: Path, jobs: str) -> None:
    tree, outside = tmp_path / "tree", tmp_path / "outside.py"
    tree.mkdir()
    for name, text in DEEP.items():
        (tree / name).write_text(text)
    (tree / "train.py").write_text(AMP)
    outside.write_text(AMP)
    (tree / "link.py").symlink_to(outside)
    (tree / "ok190.py").write_text("x = " + "(" * 190 + "1" + ")" * 190 + "\n" + AMP)  # deep but allowed
    res = run_one(["migrate", "-j", jobs, tree], tmp_path, timeout=180)
    assert res.returncode == 1, res.stdout + res.stderr  # 1: files were skipped; the run itself completed
    assert "Traceback" not in res.stderr and "internal error" not in res.stdout + res.stderr, res.stderr
    assert (tree / "train.py").read_text() == AMP_MIGRATED and outside.read_text() == AMP
    assert (tree / "ok190.py").read_text().endswith(AMP_MIGRATED)
    for name, text in DEEP.items():
        assert (tree / name).read_text() == text
        assert f"skipped {tree / name}: not parsed:" in res.stdout, (name, res.stdout)
    assert f"skipped {tree / 'link.py'}: not touched: a symlink to" in res.stdout
    assert res.stdout.rstrip().endswith(f"2 files rewritten, 0 unchanged, {len(DEEP) + 1} skipped"), res.stdout


def _crash_on_three(n: int) -> int:
    if n == 3:
        os.kill(os.getpid(), 9)  # the worker dies as under libcst's SIGSEGV (SIGKILL: no faulthandler dump)
    return n * 10


def test_a_crashing_worker_costs_only_its_own_task() -> None:
    from amplite.migrate._safety import run_in_pool

    assert run_in_pool(_crash_on_three, [1, 2, 3, 4, 5], 2) == [10, 20, None, 40, 50]


EVIL = "from pathlib import Path\nPath('MARKER').write_text('imported')\ndef f(*a, **k):\n    return []\n"


@pytest.mark.parametrize("key", ["import_modules = [\"evil\"]", "calib_loader = \"evil:f\"",
                                 "model_factory = \"evil:f\""])  # fmt: skip
def test_a_manifest_cannot_name_code_without_trust_code(model: Path, tmp_path: Path, key: str) -> None:
    from amplite.batch import load_jobs
    from amplite.batch.manifest import ManifestError

    (tmp_path / "evil.py").write_text(EVIL.replace("MARKER", str(tmp_path / "pwned")))
    manifest = tmp_path / "zoo.toml"
    manifest.write_text(f'[[model]]\nname = "m"\npath = "{model}"\n{key}\n')
    with pytest.raises(ManifestError, match=r"zoo.toml, line 4: '\w+': names Python code .* --trust-code"):
        load_jobs(manifest)
    section = f'[defaults]\n{key}\n\n[[model]]\nname = "m"\npath = "{model}"\n'
    manifest.write_text(section)
    with pytest.raises(ManifestError, match=r"line 2: .*--trust-code"):
        load_jobs(manifest)
    assert load_jobs(manifest, trust_code=True)[0].name == "m"  # the opt-in
    assert not (tmp_path / "pwned").exists()


def _batch_calls(model: Path, tmp_path: Path) -> tuple[list[list[object]], Any]:
    (tmp_path / "evil.py").write_text(EVIL.replace("MARKER", str(tmp_path / "pwned")))
    code = tmp_path / "code.toml"
    code.write_text(f'[[model]]\nname = "m"\npath = "{model}"\nimport_modules = ["evil"]\n')
    ints = tmp_path / "ints.toml"
    ints.write_text("model = [1, 2]\n")
    shards = []
    for i, doc in enumerate([{"schema": "amplite.batch", "models": 5}, {"schema": "amplite.batch", "models": [3]},
                             {"schema": "amplite.batch", "models": [], "shard": ["x"]}]):  # fmt: skip
        (tmp_path / f"s{i}").mkdir()
        (tmp_path / f"s{i}" / "summary.json").write_text(json.dumps(doc))
        shards.append(tmp_path / f"s{i}")
    calls = [["batch", code, "-o", tmp_path / "out"], ["batch", ints, "-o", tmp_path / "out"]]
    calls += [["batch", "merge", s, "-o", tmp_path / "merged"] for s in shards]
    calls.append(["batch", "merge", shards[0], "-o", shards[0]])  # the merged summary onto the shard's own
    return calls, None


def test_batch_cli_refuses_code_in_a_manifest_and_malformed_user_data(batched: dict) -> None:
    tmp_path, _, results = batched["batch"]
    results = list(results)
    assert_refused(results.pop(), "is the summary of shard")
    assert_refused(results[0], "--trust-code", "import_modules")
    assert_refused(results[1], "not a table")
    for res in results[2:]:
        assert_refused(res, "is not an amplite batch summary")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()
    assert not (tmp_path / "merged").exists()


def _golden_calls(model: Path, tmp_path: Path) -> tuple[list[list[object]], Any]:
    from amplite.gate import make_golden

    gold = make_golden(model, (torch.randn(2, 4),), output=tmp_path / "gold")
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes((gold / "inputs_000.safetensors").read_bytes())
    meta = json.loads((gold / "golden.json").read_text())
    variants = {"dotdot": "../secret.safetensors", "absolute": str(secret), "folder": "sub/x.safetensors",
                "not_a_string": 7, "symlink": "link.safetensors"}  # fmt: skip
    (gold / "link.safetensors").symlink_to(secret)
    dirs = []
    for name, file in variants.items():
        d = tmp_path / f"g_{name}"
        d.mkdir()
        for f in gold.iterdir():
            if f.is_file() and not f.is_symlink():
                (d / f.name).write_bytes(f.read_bytes())
        if name == "symlink":
            (d / "link.safetensors").symlink_to(secret)
        doc = json.loads(json.dumps(meta))
        doc["batches"][0]["inputs"]["file"] = file
        (d / "golden.json").write_text(json.dumps(doc))
        dirs.append(d)
    report = {"schema": "amplite.report", "source": {}, "verification": {"outputs": []}}
    baselines = []
    for i, broken in enumerate([{"verification": 5}, {"verification": {"outputs": [3]}},
                                {"verification": {"outputs": [{"name": ["x"]}]}}, {"source": []}]):  # fmt: skip
        b = tmp_path / f"base{i}.json"
        b.write_text(json.dumps({**report, **broken}))
        baselines.append(b)
    calls = [["check", model, "--golden", d, "--no-layerwise"] for d in dirs]
    calls += [["check", model, "--baseline", b, "--no-layerwise"] for b in baselines]
    return calls, (dirs, baselines)


def test_golden_and_baseline_files_of_the_wrong_shape_are_refused(batched: dict) -> None:
    _, (dirs, baselines), results = batched["golden"]
    for res in results[: len(dirs)]:
        assert_refused(res, "golden")
    assert "only plain file names" in results[0]["err"] and "is a symlink" in results[-len(baselines) - 1]["err"]
    for res in results[len(dirs) :]:
        assert_refused(res, "--baseline", "is not an amplite report")


def _manifest(path: Path, n: int) -> Path:
    entry = '[[model]]\nname = "m{i}"\npath = "m{i}.pt2"\ninputs = ["x:2x4:float32"]\nlevel = "O1"\n\n'
    path.write_text('[defaults]\nprecision = "fp16"\n\n' + "".join(entry.format(i=i) for i in range(n)))
    return path


def test_manifest_parsing_is_linear_in_the_number_of_entries(tmp_path: Path) -> None:
    from amplite.batch.manifest import parse_manifest

    def seconds(n: int) -> float:
        path = _manifest(tmp_path / f"m{n}.toml", n)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            assert len(parse_manifest(path)) == n
            best = min(best, time.perf_counter() - start)
        return best

    small, large = seconds(1000), seconds(4000)
    # linear: about 4x; the quadratic parser took 16x (15 s and 267 s on the same loaded machine)
    assert large / small < 7, (small, large)
    assert large < 30, large
