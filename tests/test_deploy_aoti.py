"""Issue 31: the converted program compiled for deployment — torch.compile and AOTInductor (``--format aoti``).

The package users deploy is the one verified: written, loaded back with ``aoti_load_package``, run on the
verification inputs against FP32. An AOTInductor compile takes seconds to tens of seconds on two cores, so
every artifact is built once per module (module-scoped fixtures) and shared by the tests that read it:

- ``mlp_cli``: the MLP fixture through the CLI, ``--format pt2,aoti --dynamic-batch``;
- ``builds``: a one-layer transformers GPT-2 converted bf16 O2 with ``amplite::contract`` fusion, saved as
  ``.pt2`` and as a package, and ``torch.compile``-d. The unfused plan's package is the MLP's (plain ATen
  ``addmm``, no contraction to decompose). (The causal fixture, and GPT-2 without fusion, were compiled
  too: they exercised no path these two do not - SDPA, LayerNorm, bf16 matmuls, keyword inputs and a
  ``ModelOutput`` in GPT-2, positional tensor I/O in the MLP - and their three compiles were half of
  this file's time.)

One fresh process then loads every package and every ``.pt2`` and compares them (the MLP on another batch
size, through its dynamic dimension). The planted-wrong-package test compiles nothing: it converts the MLP
with other weights and has AOTInductor write ``mlp_cli``'s package in its place.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import amplite
from fixtures.zoo import make
from tests import fresh

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def mlp_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, (args, kwargs) = make("mlp")
    path = tmp_path_factory.mktemp("aoti") / "mlp.pt2"
    torch.export.save(torch.export.export(model, args, kwargs), str(path))
    return path


@pytest.fixture(scope="module")
def mlp_cli(mlp_pt2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """``convert --format pt2,aoti --dynamic-batch`` on the MLP: (CLI result, output directory)."""
    from typer.testing import CliRunner

    from amplite.cli import app

    out = tmp_path_factory.mktemp("mlp_cli")
    args = ["convert", str(mlp_pt2), "--precision", "bf16", "--level", "O2", "--format", "pt2,aoti",
            "--dynamic-batch", "-o", str(out / "mlp.bf16.pt2")]  # fmt: skip
    return CliRunner().invoke(app, args, catch_exceptions=False), out


def _gpt2() -> tuple[torch.nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    return model, ((), {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)),
                        "use_cache": False})  # fmt: skip


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if isinstance(out, dict) else out[0]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """GPT-2 converted with fusion: result, ``.pt2`` and package paths, torch.compile output."""
    tmp = tmp_path_factory.mktemp("gpt2")
    model, inputs = _gpt2()
    args, kwargs = inputs
    out: dict[str, Any] = {"name": "gpt2", "dir": tmp, "inputs": inputs}
    res = amplite.convert(model, inputs, precision="bf16", level="O2", fuse_contractions=True)
    pt2, pkg = res.save(tmp / "fused.pt2"), res.save(tmp / "fused.aoti.pt2", format="aoti")
    with torch.no_grad():  # torch.compile of the custom op's graph
        compiled = _logits(torch.compile(res.module())(*args, **kwargs))
    out["fused"] = {"result": res, "pt2": pt2, "pkg": pkg, "compiled": compiled}
    torch.save(inputs, tmp / "inputs.pt")
    return out


def test_cli_writes_a_verified_package(mlp_cli: tuple[Any, Path]) -> None:
    res, out = mlp_cli
    assert res.exit_code == 0, res.stderr
    assert (out / "mlp.bf16.pt2").exists() and (out / "mlp.bf16.aoti.pt2").exists()
    report = json.loads((out / "mlp.bf16.report.json").read_text())
    aoti = report["verification_aoti"]
    assert aoti["passed"] is True and aoti["outputs"][0]["sqnr_db"] > 30
    assert {o["format"] for o in report["outputs"]} == {"pt2", "aoti"}
    schema = json.loads((Path(amplite.__file__).parent / "schemas" / "report.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(report)


def test_packages_are_verified_fused_and_unfused(builds: dict[str, Any], mlp_cli: tuple[Any, Path]) -> None:
    """Both plans package; the fused one had its ``amplite::contract`` nodes decomposed for the package."""
    out = mlp_cli[1]
    unfused = torch.export.load(str(out / "mlp.bf16.pt2"))  # the MLP's plan: no fusion requested
    plans = {"fused": (builds["fused"]["result"].program, builds["fused"]["result"].report.data),
             "unfused": (unfused, json.loads((out / "mlp.bf16.report.json").read_text()))}  # fmt: skip
    for variant, (program, report) in plans.items():
        contracts = sum(1 for n in program.graph.nodes if "contract" in str(n.target))
        assert (contracts > 0) == (variant == "fused"), (variant, contracts)
        entry = next(o for o in report["outputs"] if o["format"] == "aoti")
        assert entry["decomposed_contractions"] == contracts
        check = report["verification_aoti"]
        assert check["passed"] is True, check
        assert min(o["sqnr_db"] for o in check["outputs"]) > 20


def test_torch_compile_matches_the_pt2(builds: dict[str, Any]) -> None:
    args, kwargs = builds["inputs"]
    with torch.no_grad():
        eager = _logits(builds["fused"]["result"].module()(*args, **kwargs))
    compiled = builds["fused"]["compiled"]
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape
    assert torch.allclose(compiled.float(), eager.float(), atol=5e-2, rtol=5e-2), builds["name"]


FRESH = """
import json, sys, torch
import amplite  # registers amplite::contract: the fused .pt2 loads only after it
import transformers.modeling_outputs  # registers GPT-2's output class with pytree (package and .pt2)
from torch._inductor import aoti_load_package

def logits(o):
    return o if isinstance(o, torch.Tensor) else (o["logits"] if isinstance(o, dict) else o[0])

out = {}
for pkg, pt2, inputs in json.loads(sys.argv[1]):
    if inputs == "mlp":  # another batch size than the example's: the package's dynamic dimension
        args, kwargs = (torch.randn(7, 32, generator=torch.Generator().manual_seed(3)),), {}
    else:
        args, kwargs = torch.load(inputs, weights_only=False)
    with torch.no_grad():
        a = logits(aoti_load_package(pkg)(*args, **kwargs))
        b = logits(torch.export.load(pt2).module()(*args, **kwargs))
    out[pkg] = [str(a.dtype), str(b.dtype), list(a.shape), list(b.shape), float((a.float() - b.float()).abs().max())]
print(json.dumps(out))
"""


def test_packages_match_the_pt2_in_a_fresh_process(mlp_cli: tuple[Any, Path], builds: dict[str, Any]) -> None:
    """Every package and every ``.pt2`` loaded in a process that built none of them; same outputs."""
    jobs = [[str(mlp_cli[1] / "mlp.bf16.aoti.pt2"), str(mlp_cli[1] / "mlp.bf16.pt2"), "mlp"]]
    jobs.append([str(builds["fused"]["pkg"]), str(builds["fused"]["pt2"]), str(builds["dir"] / "inputs.pt")])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = fresh.run([sys.executable, "-c", FRESH, json.dumps(jobs)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {j[0] for j in jobs}
    for pkg, (dt_a, dt_b, shape_a, shape_b, diff) in got.items():
        assert dt_a == dt_b and shape_a == shape_b, pkg
        assert diff < 5e-2, (pkg, diff)  # compiled vs eager bf16: the same plan, kernel-order rounding only
    assert got[jobs[0][0]][2][0] == 7  # the MLP package took batch 7 (exported with 4)


def test_planted_wrong_package_fails_verification(
    mlp_cli: tuple[Any, Path], tmp_path: Path, cli, monkeypatch
) -> None:
    """The verification runs the written package: a package built from other weights exits 1.

    The MLP with its weights scaled by 1.5 is converted; AOTInductor is made to write the package it built for
    the original MLP (``mlp_cli``: same signature, other weights) - no second compile. The ``.pt2`` is right,
    the package is not, and only the package's verification can tell.
    """
    import shutil

    import torch._inductor

    model, (args, kwargs) = make("mlp")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight"):
                param.mul_(1.5)
    src = tmp_path / "scaled.pt2"
    torch.export.save(torch.export.export(model, args, kwargs), str(src))
    built_elsewhere = mlp_cli[1] / "mlp.bf16.aoti.pt2"

    def planted(program: Any, package_path: str, **_kw: Any) -> str:
        shutil.copyfile(built_elsewhere, package_path)
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", planted)
    res = cli("convert", src, "--precision", "bf16", "--format", "aoti", "-o", tmp_path / "bad.pt2")
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
