"""The Accelerate recipe (examples/train_accelerate.py) and the lazy imports of amplite.integrations."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest

from tests import fresh

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


MISSING = [
    ("amplite.integrations.lightning", "lightning", "amplite[lightning]"),
    ("amplite.integrations.transformers", "transformers", "amplite[transformers]"),
]

#: One fresh interpreter: amplite and amplite.integrations import without the frameworks; then each framework
#: is made unimportable in turn (``sys.modules[name] = None``) and its integration imported: what it raises.
FRESH = """
import json, sys
import amplite, amplite.integrations
out = {"heavy": [m for m in ("lightning", "pytorch_lightning", "accelerate", "transformers") if m in sys.modules]}
for module, blocked, _ in json.loads(sys.argv[1]):
    sys.modules[blocked] = None
    try:
        __import__(module)
        out[module] = None
    except Exception as exc:
        out[module] = [type(exc).__name__, isinstance(exc, ImportError), str(exc)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    done = fresh.run([sys.executable, "-c", FRESH, json.dumps(MISSING)], cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_amplite_and_amplite_integrations_import_without_the_frameworks(fresh_imports: dict):
    assert fresh_imports["heavy"] == []


@pytest.mark.parametrize(("module", "blocked", "extra"), MISSING)
def test_a_missing_framework_names_the_extra(module, blocked, extra, fresh_imports: dict):
    raised = fresh_imports[module]  # the import of the integration, its framework unimportable
    assert raised is not None and raised[1], raised  # an ImportError: it stops the user's import
    assert f"pip install '{extra}'" in raised[2], raised
