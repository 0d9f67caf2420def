"""tests/fresh.py: a forked "fresh process" behaves as ``python`` started anew, torch's import aside."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fresh

PY = sys.executable
CASES = {
    "argv, path and exit 0": [PY, "-c", "import sys; print(sys.argv[1:], repr(sys.path[0]))", "a", "b c"],
    "exit code": [PY, "-c", "import sys; sys.exit(3)"],
    "exit message": [PY, "-c", "import sys; print('x', file=sys.stderr); sys.exit('why')"],
    "uncaught exception": [PY, "-c", "def f():\n    raise ValueError('boom')\nf()"],
    "syntax error": [PY, "-c", "print(("],
    "stdin, env and cwd": [PY, "-c", "import os, sys; print(sys.stdin.read().upper(), os.environ['X'], os.getcwd())"],
    "atexit, unflushed output": [PY, "-c", "import atexit, sys; atexit.register(print, 1); sys.stdout.write('hi')"],
    "a script": [PY, "script.py", "arg"],
    "a module": [PY, "-m", "mod", "arg"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_forked_child_matches_a_new_interpreter(name: str, tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text("import sys\nprint(__name__, sys.argv, sys.path[0])\n")
    (tmp_path / "mod.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\nraise SystemExit(4)\n")
    env = {"PATH": os.environ.get("PATH", ""), "X": "y", "PYTHONPATH": str(tmp_path)}
    kwargs = {"cwd": tmp_path, "env": env, "timeout": 60, "input": "in"}
    want = subprocess.run(CASES[name], capture_output=True, text=True, **kwargs)
    got = fresh.run(CASES[name], **kwargs)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


def test_only_torch_is_imported_beforehand_and_limits_and_timeouts_apply() -> None:
    code = "import sys; print(sorted(m for m in ('torch', 'amplite', 'transformers', 'pytest') if m in sys.modules))"
    assert fresh.run([PY, "-c", code]).stdout.strip() == "['torch']"
    limit = "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])"
    assert fresh.run([PY, "-c", limit], rlimits={resource.RLIMIT_AS: 3 << 30}).stdout.strip() == str(3 << 30)
    with pytest.raises(subprocess.TimeoutExpired):
        fresh.run([PY, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert fresh.run([PY, "-c", "print('after')"]).stdout == "after\n"  # the server goes on after a kill
    with pytest.raises(ValueError, match="this interpreter only"):
        fresh.run(["python3", "-c", "pass"])
