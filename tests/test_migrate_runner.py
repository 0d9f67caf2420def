"""Tests of the migrate runner: the fixture corpus, file modes, atomic writes, walking, parallelism."""

from __future__ import annotations

import ast
import difflib
import io
import re
import shutil
import stat
import tokenize
from pathlib import Path

import libcst as cst
import pytest

from amplite.migrate import format_report, migrate_paths, migrate_source
from amplite.migrate import runner as runner_module

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "fixtures" / "scripts"
CORPUS = ("apex_imagenet.py", "cuda_amp_loop.py", "plain_fp32_loop.py")
OPTIONS = {"add_autocast": True, "dtype": "fp16"}

#: Deprecated APIs, matched on the code's NAME/OP tokens (comments and strings do not count).
DEPRECATED = re.compile(
    r"\btorch \. (cuda|cpu) \. amp\b|\b(cuda|cpu) import amp\b|\bapex\b|\bamp \. initialize\b|\bamp \. scale_loss\b"
)
#: What an AMP-related line mentions.
AMP_WORDS = r"amp|autocast|GradScaler|scaler|apex|custom_fwd|custom_bwd|\.step\(|\.backward\(|master_params"


@pytest.fixture(scope="module")
def corpus() -> dict[str, tuple[str, str, list[str]]]:
    """name -> (original, migrated, warnings) for each fixture script."""
    result = {}
    for name in CORPUS:
        before = (SCRIPTS / name).read_text()
        after, warnings = migrate_source(before, **OPTIONS)
        result[name] = (before, after, warnings)
    return result


def code_tokens(source: str) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return " ".join(t.string for t in tokens if t.type in (tokenize.NAME, tokenize.OP))


def amp_pattern(source: str) -> re.Pattern[str]:
    """AMP words plus the local aliases of deprecated imports (``autocast as ac``)."""
    aliases = [
        alias.asname
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module and re.match(r"torch\.(cuda|cpu)\.amp|apex", node.module)
        for alias in node.names
        if alias.asname
    ]
    return re.compile("|".join([AMP_WORDS, *(rf"\b{re.escape(a)}\(" for a in aliases)]))


def amp_lines(source: str) -> set[int]:
    """0-based indices of the original lines belonging to AMP-related statements (headers only for blocks)."""
    lines = source.splitlines()
    pattern = amp_pattern(source)
    marked: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        spans = []
        if isinstance(node, ast.Try) and all(isinstance(s, ast.Import | ast.ImportFrom) for s in node.body):
            spans.append((node.lineno - 1, node.end_lineno or node.lineno))  # an import guard as a whole
        elif isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno or node.lineno
            spans.append((node.lineno - 1, end))
        for decorator in getattr(node, "decorator_list", []):
            spans.append((decorator.lineno - 1, decorator.end_lineno or decorator.lineno))
        for start, stop in spans:
            if pattern.search("\n".join(lines[start:stop])):
                marked.update(range(start, stop))
    return marked


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_has_no_deprecated_api_left(corpus: dict[str, tuple[str, str, list[str]]], name: str) -> None:
    before, after, warnings = corpus[name]
    # apex's command-line options that only fed amp.initialize are reported (issue 14.11), nothing else
    options = ((33, "opt-level"), (34, "keep-batchnorm-fp32"), (35, "loss-scale"))
    dead = [f"line {n}: option `--{o}` no longer does anything" for n, o in options]
    dead = dead if name == "apex_imagenet.py" else []
    assert [w.split(":", 2)[0] + ":" + w.split(":", 2)[1].split(" no longer")[0] + " no longer does anything"
            for w in warnings] == dead, warnings  # fmt: skip
    if name != "plain_fp32_loop.py":
        assert DEPRECATED.search(code_tokens(before))  # the fixture really exercises the migration
    assert not DEPRECATED.search(code_tokens(after))


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_compiles_and_is_idempotent(corpus: dict[str, tuple[str, str, list[str]]], name: str) -> None:
    _, after, _ = corpus[name]
    compile(after, name, "exec")
    assert migrate_source(after, **OPTIONS) == (after, [])


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_changes_only_amp_statements(corpus: dict[str, tuple[str, str, list[str]]], name: str) -> None:
    before, after, _ = corpus[name]
    old, new = before.splitlines(), after.splitlines()
    marked, pattern = amp_lines(before), amp_pattern(before)
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    hunks = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    assert hunks
    for _, i1, i2, j1, j2 in hunks:
        removed = {line.strip() for line in old[i1:i2]}
        added = {line.strip() for line in new[j1:j2]}
        for i in range(i1, i2):
            # A non-AMP line may only move (e.g. into a `with torch.autocast` block), never change.
            assert i in marked or not old[i].strip() or old[i].strip() in added, f"{name}:{i + 1}: {old[i]!r}"
        rewrites_amp = any(i in marked for i in range(i1, i2))
        for line in new[j1:j2]:
            text = line.strip()
            new_amp = pattern.search(line) or text.startswith("# amplite:") or text == "import torch"
            assert rewrites_amp or new_amp or not text or text in removed, f"{name}: added {line!r}"


def test_corpus_key_rewrites(corpus: dict[str, tuple[str, str, list[str]]]) -> None:
    apex = corpus["apex_imagenet.py"][1]
    assert (
        "    # amplite: opt_level=args.opt_level is not a literal: migrated as O1\n"
        "    # amplite: dropped amp.initialize options: keep_batchnorm_fp32, loss_scale\n"
        "    global scaler\n"
        '    scaler = torch.amp.GradScaler("cuda")\n'
    ) in apex
    assert (
        "        # compute output\n"
        '        with torch.autocast("cuda", dtype=torch.float16):\n'
        "            output = model(images)\n"
        "            loss = criterion(output, target)\n"
    ) in apex
    assert "        scaler.scale(loss).backward()  # dynamic loss scaling\n" in apex
    assert (
        "            scaler.unscale_(optimizer)\n"
        "            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)\n"
        "\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
    ) in apex
    assert '"amp": scaler.state_dict(),' in apex
    assert 'scaler.load_state_dict(checkpoint["amp"])  # restore the loss scaler' in apex
    cuda = corpus["cuda_amp_loop.py"][1]
    assert '    @torch.amp.custom_bwd(device_type="cuda")\n' in cuda
    assert '    with torch.amp.autocast("cuda", enabled=True, dtype=torch.float16):\n' in cuda
    plain = corpus["plain_fp32_loop.py"][1]
    assert "    scaler = torch.amp.GradScaler(device.type)\n    for batch_idx" in plain
    assert "        scaler.step(optimizer)  # update the weights\n        scaler.update()\n" in plain


SMALL = "import torch\nfrom torch.cuda import amp\n\nwith amp.autocast():  # fwd\n    y = model(x)\n"
SMALL_MIGRATED = 'import torch\n\nwith torch.amp.autocast("cuda"):  # fwd\n    y = model(x)\n'


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the corpus, plus an unparseable file."""
    target = tmp_path / "scripts"
    shutil.copytree(SCRIPTS, target)
    (target / "broken.py").write_text("def f(:\n    pass\n")
    return target


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_check_reports_changes_and_touches_nothing(
    workdir: Path, corpus: dict[str, tuple[str, str, list[str]]]
) -> None:
    before = snapshot(workdir)
    report = migrate_paths([workdir], mode="check", **OPTIONS)
    assert snapshot(workdir) == before
    assert report.exit_code == 1
    assert {f.path.name: f.changed for f in report.files} == {
        "apex_imagenet.py": True,
        "broken.py": False,
        "cuda_amp_loop.py": True,
        "plain_fp32_loop.py": True,
    }
    (workdir / "broken.py").unlink()
    for name in CORPUS:
        (workdir / name).write_text(corpus[name][1])
    clean = migrate_paths([workdir], mode="check", **OPTIONS)
    assert clean.exit_code == 0
    assert format_report(clean) == "0 files would be rewritten, 3 unchanged"


def test_diff_changes_nothing_and_shows_the_migration(
    workdir: Path, corpus: dict[str, tuple[str, str, list[str]]]
) -> None:
    before = snapshot(workdir)
    path = workdir / "cuda_amp_loop.py"
    report = migrate_paths([path], mode="diff", **OPTIONS)
    assert snapshot(workdir) == before
    assert report.exit_code == 0
    (result,) = report.files
    original, migrated, _ = corpus["cuda_amp_loop.py"]
    expected = "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            migrated.splitlines(keepends=True),
            f"a/{str(path).lstrip('/')}",
            f"b/{str(path).lstrip('/')}",
        )
    )
    assert result.diff == expected
    assert '-    @torch.cuda.amp.custom_bwd\n+    @torch.amp.custom_bwd(device_type="cuda")\n' in expected
    assert format_report(report) == expected.rstrip("\n") + "\n1 file would be rewritten, 0 unchanged"


def test_write_is_atomic_and_keeps_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(SMALL)
    path.chmod(0o751)
    inode = path.stat().st_ino
    report = migrate_paths([path])
    assert report.exit_code == 0
    assert path.read_text() == SMALL_MIGRATED
    assert stat.S_IMODE(path.stat().st_mode) == 0o751
    assert path.stat().st_ino != inode  # replaced by a rename, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary file left behind
    assert format_report(report) == f"rewrote {path}\n1 file rewritten, 0 unchanged"


def test_write_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    target = tmp_path / "train.py"
    target.write_text(SMALL)
    link = tmp_path / "link.py"
    link.symlink_to(target)
    migrate_paths([link])
    assert link.is_symlink()
    assert target.read_text() == SMALL_MIGRATED


def test_failed_write_leaves_the_original(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.py"
    path.write_text(SMALL)

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(runner_module.os, "replace", refuse)
    report = migrate_paths([path])
    assert path.read_text() == SMALL
    assert report.files[0].error == "cannot write: Permission denied"
    assert report.exit_code == 1
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_unparseable_file_is_reported_and_skipped(tmp_path: Path) -> None:
    broken, good = tmp_path / "broken.py", tmp_path / "good.py"
    broken.write_text("def f(:\n    pass\n")
    good.write_text(SMALL)
    report = migrate_paths([broken, good])
    assert broken.read_text() == "def f(:\n    pass\n"
    assert good.read_text() == SMALL_MIGRATED
    assert [(f.changed, f.error) for f in report.files] == [
        (False, "cannot parse: line 1: invalid syntax"),
        (True, None),
    ]
    assert report.exit_code == 1
    assert format_report(report).splitlines() == [
        f"skipped {broken}: cannot parse: line 1: invalid syntax",
        f"rewrote {good}",
        "1 file rewritten, 0 unchanged, 1 skipped",
    ]
    with pytest.raises(cst.ParserSyntaxError):
        migrate_source("def f(:\n")


def test_migrated_code_that_would_not_compile_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.py"
    path.write_text(SMALL)
    real = runner_module.migrate_module

    def broken(module: cst.Module, **kwargs: object) -> tuple[cst.Module, list[str]]:
        new, warnings = real(module, **kwargs)  # type: ignore[arg-type]
        return cst.parse_module(new.code + "return\n"), warnings  # `return` outside a function

    monkeypatch.setattr(runner_module, "migrate_module", broken)
    report = migrate_paths([path])
    assert path.read_text() == SMALL
    assert report.files[0].error == "internal error, file left unchanged: the migrated code does not compile"


def test_codemod_crash_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.py"
    path.write_text(SMALL)

    def crash(module: cst.Module, **kwargs: object) -> tuple[cst.Module, list[str]]:
        raise RuntimeError("boom")

    monkeypatch.setattr(runner_module, "migrate_module", crash)
    report = migrate_paths([path])
    assert path.read_text() == SMALL
    assert report.files[0].error == "internal error, file left unchanged: RuntimeError: boom"


def test_directory_walk(tmp_path: Path) -> None:
    old = SMALL
    for rel in ("a.py", "pkg/b.py", "pkg/deep/c.py", ".hidden/d.py", "pkg/__pycache__/e.py", "venv/f.py", "g.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(old)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "script").write_text(old)
    report = migrate_paths(
        [tmp_path, tmp_path / "pkg" / "b.py", tmp_path / "script", tmp_path / "missing.py"], mode="check"
    )
    names = [str(f.path.relative_to(tmp_path)) for f in report.files]
    assert names == ["missing.py", "a.py", "pkg/b.py", "pkg/deep/c.py", "script"]
    assert report.files[0].error == "no such file or directory"
    assert all(f.changed for f in report.files[1:])


def test_parallel_jobs_match_serial(tmp_path: Path) -> None:
    sources = {
        "a.py": SMALL,
        "b.py": "from apex import amp\nmodel, opt = amp.initialize(model, opt)\nuse(amp)\n",  # warns
        "c.py": "for x in data:\n    loss = model(x)\n    loss.backward()\n    optimizer.step()\n",
        "d.py": "def f(:\n",  # does not parse
        "e.py": "x = 1\n",  # nothing to do
    }
    for name, source in sources.items():
        (tmp_path / name).write_text(source)
    serial = migrate_paths([tmp_path], mode="diff", **OPTIONS)
    parallel = migrate_paths([tmp_path], mode="diff", jobs=2, **OPTIONS)
    outcome = [(f.path.name, f.changed, f.diff, f.error, f.warnings) for f in serial.files]
    assert [(f.path.name, f.changed, f.diff, f.error, f.warnings) for f in parallel.files] == outcome
    assert [(name, changed, bool(error), len(warnings)) for name, changed, _, error, warnings in outcome] == [
        ("a.py", True, False, 0),
        ("b.py", False, False, 2),
        ("c.py", True, False, 0),
        ("d.py", False, True, 0),
        ("e.py", False, False, 0),
    ]


def test_warnings_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_bytes(
        b"import torch\r\nfrom torch.cuda import amp\r\n"
        b"from apex.parallel import DistributedDataParallel as DDP\r\n"
        b"model = DDP(model)\r\nwith amp.autocast():\r\n    pass\r\n"
    )
    report = migrate_paths([path])
    assert path.read_bytes() == (
        b"import torch\r\nfrom apex.parallel import DistributedDataParallel as DDP\r\n"
        b'model = DDP(model)\r\nwith torch.amp.autocast("cuda"):\r\n    pass\r\n'
    )
    # Line numbers cite the file as it was: DDP is on line 4 before the rewrite removed line 2.
    warning = "line 4: `DDP` (apex.parallel.DistributedDataParallel) is left unchanged; migrate it by hand"
    assert format_report(report).splitlines() == [
        f"rewrote {path}",
        f"{path}: warning: {warning}",
        "1 file rewritten, 0 unchanged",
    ]


def test_invalid_options_and_empty_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        migrate_paths([tmp_path], mode="dry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        migrate_paths([tmp_path], dtype="fp8")  # type: ignore[arg-type]
    report = migrate_paths([tmp_path])
    assert report.exit_code == 0
    assert format_report(report) == "no Python files found"


def test_pre_commit_hook() -> None:
    yaml = pytest.importorskip("yaml")
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "amplite-migrate"]
    assert hook["entry"] == "amplite migrate --check"
    assert hook["language"] == "python"
    assert hook["types"] == ["python"]


def test_leftovers_are_reported_once_per_line() -> None:
    code = (
        "from torch.cuda.amp import *\n"
        "import apex.parallel\n"
        "with autocast():\n"
        "    model = apex.parallel.convert_syncbn_model(model)\n"
    )
    assert migrate_source(code) == (
        code,
        [
            "line 1: `from torch.cuda.amp import *` (torch.cuda.amp) is left unchanged; migrate it by hand",
            "line 4: `apex.parallel.convert_syncbn_model` (apex.parallel.convert_syncbn_model) is left unchanged; "
            "migrate it by hand",
        ],
    )


APEX_SCRIPT = """
import torch
from apex import amp

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
x, y = torch.randn(64, 8), torch.randn(64, 1)
losses = []
for step in range(30):
    out = model(x)
    loss = torch.nn.functional.mse_loss(out, y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    optimizer.step()
    losses.append(loss.item())
"""
TORCH_AMP_SCRIPT = """
import torch
from torch.cuda.amp import custom_fwd, custom_bwd, GradScaler
from torch.cpu import amp

class Square(torch.autograd.Function):
    @staticmethod
    @custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @custom_bwd
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 1))
optimizer = torch.optim.SGD([w], lr=0.05)
scaler = GradScaler(enabled=False)
x, y = torch.randn(64, 8), torch.randn(64, 1)
losses = []
for step in range(30):
    with amp.autocast(dtype=torch.bfloat16):
        loss = (Square.apply(x @ w) - y).abs().mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    losses.append(loss.item())
"""
PLAIN_SCRIPT = """
import torch
device = torch.device("cpu")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)
losses = []
for epoch in range(3):
    for step in range(10):
        xb, yb = x.to(device), y.to(device)
        pred = model(xb)
        loss = torch.nn.functional.mse_loss(pred.float(), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
"""
RUNNABLE = {
    "apex": (APEX_SCRIPT, {}),
    "torch_amp": (TORCH_AMP_SCRIPT, {}),
    "add_autocast_fp16": (PLAIN_SCRIPT, {"add_autocast": True, "dtype": "fp16"}),
    "add_autocast_bf16": (PLAIN_SCRIPT, {"add_autocast": True, "dtype": "bf16"}),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # "cuda" autocast/GradScaler disable themselves on CPU
@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_migrated_scripts_train_on_cpu(name: str) -> None:
    torch = pytest.importorskip("torch")
    source, options = RUNNABLE[name]
    migrated, warnings = migrate_source(source, **options)  # type: ignore[arg-type]
    assert warnings == [] and migrated != source
    namespace: dict[str, object] = {}
    exec(compile(migrated, name, "exec"), namespace)
    losses = namespace["losses"]
    assert isinstance(losses, list) and len(losses) == 30 and losses[-1] < 0.8 * losses[0]
    if name == "add_autocast_fp16":  # the CPU GradScaler really scales
        scaler = namespace["scaler"]
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
