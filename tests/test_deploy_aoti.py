"""Issue 31: the converted program compiled for deployment — torch.compile and AOTInductor (``--format aoti``).

The package users deploy is the one verified: written, loaded back with ``aoti_load_package``, run on the
verification inputs against FP32. Each AOTInductor compile takes tens of seconds on two cores, so the
tests compile three programs in all: a fixture through the CLI (dynamic batch, checked in a fresh process on
another batch size), one with ``amplite::contract`` (decomposed for the package), and a transformers GPT-2.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

import amplite
from fixtures.zoo import make

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def mlp_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, (args, kwargs) = make("mlp")
    path = tmp_path_factory.mktemp("aoti") / "mlp.pt2"
    torch.export.save(torch.export.export(model, args, kwargs), str(path))
    return path


def _fresh(code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_cli_writes_a_verified_package_that_runs_in_a_fresh_process(mlp_pt2: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "mlp.bf16.pt2"
    res = cli("convert", mlp_pt2, "--precision", "bf16", "--level", "O2", "--format", "pt2,aoti",
              "--dynamic-batch", "-o", out)  # fmt: skip
    assert res.exit_code == 0, res.stderr
    package = tmp_path / "mlp.bf16.aoti.pt2"
    assert out.exists() and package.exists()
    report = json.loads((tmp_path / "mlp.bf16.report.json").read_text())
    aoti = report["verification_aoti"]
    assert aoti["passed"] is True and aoti["outputs"][0]["sqnr_db"] > 30
    assert {o["format"] for o in report["outputs"]} == {"pt2", "aoti"}
    schema = json.loads((Path(amplite.__file__).parent / "schemas" / "report.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(report)
    # The package on another batch size, in a fresh process, against the .pt2 amplite wrote.
    code = (
        "import torch\n"
        "from torch._inductor import aoti_load_package\n"
        f"pkg = aoti_load_package({str(package)!r})\n"
        f"ep = torch.export.load({str(out)!r})\n"
        "x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3))\n"
        "a, b = pkg(x), ep.module()(x)\n"
        "print(a.dtype, tuple(a.shape), float((a.float() - b.float()).abs().max()))\n"
    )
    line = _fresh(code, tmp_path).strip()
    assert line.startswith("torch.float32 (7,"), line
    assert float(line.rsplit(" ", 1)[1]) < 1e-2  # compiled vs eager bf16: same plan, kernel-order rounding only


def test_planted_wrong_package_fails_verification(mlp_pt2: Path, tmp_path: Path, cli, monkeypatch) -> None:
    """The verification runs the written package: a package built from wrong weights exits 1."""
    from amplite.deploy import aoti

    real = aoti._decompose_contractions

    def planted(program):
        program, n = real(program)
        wrong = copy.deepcopy(program)
        for name, value in wrong.state_dict.items():
            if name.endswith("weight"):
                wrong.state_dict[name] = torch.nn.Parameter(value.detach() * 1.5, requires_grad=False)
        return wrong, n

    monkeypatch.setattr(aoti, "_decompose_contractions", planted)
    res = cli("convert", mlp_pt2, "--precision", "bf16", "--format", "aoti", "-o", tmp_path / "bad.pt2")
    assert res.exit_code == 1, res.stderr
    report = json.loads((tmp_path / "bad.report.json").read_text())
    assert report["verification_aoti"]["passed"] is False
    assert report["verification"]["passed"] is True  # the .pt2 path was right: only the package is wrong


def test_no_cxx_compiler_is_a_one_line_error_before_work(mlp_pt2: Path, tmp_path: Path, cli, monkeypatch) -> None:
    from amplite.deploy import aoti

    monkeypatch.setattr(aoti.shutil, "which", lambda _name: None)
    res = cli("convert", mlp_pt2, "--format", "aoti", "-o", tmp_path / "x.pt2")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "C++ compiler" in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())


def test_fused_contraction_is_decomposed_and_matches(tmp_path: Path) -> None:
    model, inputs = make("causal")
    result = amplite.convert(model, inputs, precision="bf16", level="O2", fuse_contractions=True)
    assert any("contract" in str(n.target) for n in result.program.graph.nodes)
    path = result.save(tmp_path / "causal.pt2", format="aoti")
    entry = next(o for o in result.report.data["outputs"] if o["format"] == "aoti")
    assert entry["decomposed_contractions"] >= 1
    assert result.report.data["verification_aoti"]["passed"] is True
    from amplite.deploy.aoti import load_aoti

    args, kwargs = inputs
    got, want = load_aoti(path)(*args, **kwargs), result.module()(*args, **kwargs)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_transformers_gpt2_packages_and_compiles(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    result = amplite.convert(model, ((), {"input_ids": ids, "use_cache": False}), precision="bf16", level="O2")
    path = result.save(tmp_path / "gpt2.pt2", format="aoti")
    assert result.report.data["verification_aoti"]["passed"] is True
    from amplite.deploy.aoti import load_aoti

    eager = result.module()(input_ids=ids, use_cache=False)
    packaged = load_aoti(path)(input_ids=ids, use_cache=False)
    eager_logits = eager["logits"] if isinstance(eager, dict) else eager[0]
    packaged_logits = packaged["logits"] if isinstance(packaged, dict) else packaged[0]
    assert torch.allclose(packaged_logits.float(), eager_logits.float(), atol=5e-2, rtol=5e-2)
    compiled = torch.compile(result.module())  # the Python-service path: torch.compile of the converted module
    logits = compiled(input_ids=ids, use_cache=False)
    logits = logits["logits"] if isinstance(logits, dict) else logits[0]
    assert torch.allclose(logits.float(), eager_logits.float(), atol=5e-2, rtol=5e-2)
