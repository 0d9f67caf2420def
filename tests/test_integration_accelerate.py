"""The Accelerate recipe (examples/train_accelerate.py) and the lazy imports of amplite.integrations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_accelerate_recipe_matches_accelerate_bf16(monkeypatch):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the recipe imports the Trainer example's model and data
    spec = importlib.util.spec_from_file_location("train_accelerate", ROOT / "examples" / "train_accelerate.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ex.run("amplite", 20)
        AcceleratorState._reset_state(True)  # one mixed-precision setting per process, as in a script
        auto = ex.run("bf16", 20)
        AcceleratorState._reset_state(True)
    assert len(ours) == len(auto) == 20
    assert max(abs(a - b) / b for a, b in zip(ours, auto, strict=True)) < 0.01
    assert ours[-1] < 0.9 * ours[0]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_amplite_and_amplite_integrations_import_without_the_frameworks():
    done = _python(
        "import sys, amplite, amplite.integrations\n"
        "heavy = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'transformers') if m in sys.modules]\n"
        "print(heavy)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "blocked", "extra"), [
    ("amplite.integrations.lightning", "lightning", "amplite[lightning]"),
    ("amplite.integrations.transformers", "transformers", "amplite[transformers]"),
])  # fmt: skip
def test_a_missing_framework_names_the_extra(module, blocked, extra):
    done = _python(f"import sys; sys.modules[{blocked!r}] = None\nimport amplite\nimport {module}")
    assert done.returncode == 1
    assert f"pip install '{extra}'" in done.stderr.strip().splitlines()[-1]
