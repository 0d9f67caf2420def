"""Streaming conversion of a sharded transformers checkpoint directory (tiny Llama, 3+ shards)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # dev extra: a missing install fails, it does not skip

import amplite
from amplite import op_tables
from amplite.checkpoint import StreamedConversion
from amplite.checkpoint.source import LogitsOnly, open_checkpoint
from amplite.errors import AmpliteError
from tests import fresh
from tests.conftest import Cli

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "tiny-llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    model.save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m amplite`` in a fresh interpreter: kept for the one end-to-end ``convert DIR`` below (the
    module's outputs come from the command as a user runs it); refusals run in-process (``cli``)."""
    return fresh.run([sys.executable, "-m", "amplite", *args], cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def converted(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    out = tmp_path_factory.mktemp("out")
    proc = _run("convert", str(ckpt), "--precision", "fp16", "--level", "O2", "--format", "safetensors,pt2",
                "-o", str(out / "llama.fp16"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "block-wise: 2 blocks compared" in proc.stdout
    report = json.loads((out / "llama.fp16.report.json").read_text())
    return out / "llama.fp16", out / "llama.fp16.pt2", report


def test_streamed_weights_and_plan_equal_the_in_memory_conversion(ckpt: Path, converted: tuple) -> None:
    from safetensors.torch import load_file

    st_dir, _, report = converted
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    memory = amplite.convert(LogitsOnly(model), (_ids(0),), precision="fp16", level="O2", range_rules=False,
                             fold_batchnorm=False, verify=False)  # fmt: skip
    streamed = {}
    for shard in sorted(st_dir.glob("*.safetensors")):
        streamed.update(load_file(shard))
    expected = {k.removeprefix("lm."): v for k, v in memory.program.state_dict.items()}
    assert set(expected) <= set(streamed)
    for name, t in expected.items():
        assert streamed[name].dtype == t.dtype, name
        assert torch.equal(streamed[name], t), name
    # The same decisions for every compute op and every FP32 island (tracing on meta keeps a few more
    # data-movement nodes, e.g. ``contiguous``, than tracing on real tensors; they follow their inputs).
    def decisions(plan: list[dict]) -> list[tuple]:
        return [(p["module"], p["op"], p["mode"], p["dtype"]) for p in plan
                if p["op"] in op_tables.LOW_PRECISION_OPS or p["mode"] == "fp32"]  # fmt: skip

    assert decisions(report["plan"]) == decisions(memory.report.data["plan"])
    assert len(decisions(report["plan"])) > 10
    assert report["weights"]["ratio"] == pytest.approx(0.5, abs=0.01)
    assert report["verification"]["passed"] and len(report["verification"]["blocks"]) == 2


def test_safetensors_output_loads_into_a_meta_built_model_and_matches(ckpt: Path, converted: tuple) -> None:
    from safetensors.torch import load_file

    st_dir, _, _ = converted
    state = {}
    for shard in st_dir.glob("*.safetensors"):
        state.update(load_file(shard))
    assert {t.dtype for t in state.values()} == {torch.float16}  # O2 fp16: every stored weight is low
    index = json.loads((st_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]  # same layout
    assert (st_dir / "config.json").exists() and (st_dir / "amplite-plan.json").exists()
    with torch.device("meta"):
        low = transformers.LlamaForCausalLM(_config())
    missing, unexpected = low.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    low.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(_config())
    ref = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    ids = _ids(3)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = low.eval()(input_ids=ids).logits.float()
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum())
    assert sqnr > 30, f"fp16 weights loaded from the safetensors output: SQNR {float(sqnr):.1f} dB"


def test_saved_pt2_runs_in_a_fresh_process_on_other_inputs(ckpt: Path, converted: tuple, tmp_path: Path) -> None:
    _, pt2, _ = converted
    ids = _ids(7)
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch, amplite\n"
        "ep = torch.export.load(sys.argv[1])\n"
        "out = ep.module()(torch.load(sys.argv[2]))\n"
        "torch.save(out, sys.argv[3])\n"
    )
    proc = fresh.run([sys.executable, "-c", script, str(pt2), str(tmp_path / "ids.pt"), str(tmp_path / "o.pt")],
                     cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "o.pt")
    ref = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    err = (got.float() - expected).pow(2).sum()
    sqnr = 10 * torch.log10(expected.pow(2).sum() / err)
    assert sqnr > 40, f"saved .pt2 SQNR {float(sqnr):.1f} dB"


def test_api_plans_from_metadata_without_materialising(ckpt: Path) -> None:
    result = amplite.convert(ckpt, precision="bf16", level="O1")
    assert isinstance(result, StreamedConversion)
    assert all(t.device.type == "meta" for t in result.program.state_dict.values())
    assert result.data["weights"]["ratio"] == 1.0  # O1 keeps the FP32 masters
    assert result.passed is None  # nothing verified until written


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("defect", ["no-config", "missing-shard", "truncated-shard", "bad-config", "bad-index"])
def test_bad_checkpoints_exit_2_naming_the_file_and_leave_nothing(ckpt: Path, tmp_path: Path, defect: str,
                                                                   cli: Cli) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    shards = sorted(bad.glob("*.safetensors"))
    if defect == "no-config":
        (bad / "config.json").unlink()
        expect = "config.json"
    elif defect == "missing-shard":
        shards[1].unlink()
        expect = shards[1].name
    elif defect == "truncated-shard":
        shards[0].write_bytes(shards[0].read_bytes()[:200])
        expect = shards[0].name
    elif defect == "bad-config":
        cfg = json.loads((bad / "config.json").read_text())
        cfg.update(model_type="no-such-model", architectures=["NoSuchForCausalLM"])
        (bad / "config.json").write_text(json.dumps(cfg))
        expect = "config.json"
    else:
        (bad / "model.safetensors.index.json").write_text("{not json")
        expect = "index"
    out = tmp_path / "out"
    out.mkdir()
    if defect in ("no-config", "missing-shard"):  # the CLI (in-process: the same handler): one line, exit 2
        res = cli("convert", bad, "-o", out / "m", "--format", "safetensors,pt2")
        assert res.exit_code == 2, res.stdout + res.stderr
        assert expect in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    else:  # the library: the same errors, in-process (faster)
        from amplite.save import convert_to_files

        with pytest.raises(AmpliteError, match=expect) as info:
            convert_to_files(bad, output=out / "m", formats="safetensors,pt2")
        assert info.value.exit_code == 2
    assert list(out.iterdir()) == []


def test_verify_max_memory_too_small_is_refused_before_writing_a_report(ckpt: Path, tmp_path: Path, cli) -> None:
    res = cli("convert", ckpt, "-o", tmp_path / "m", "--verify-max-memory", "0.00001")  # in-process: exit 2 + line
    assert res.exit_code == 2 and "--verify-max-memory" in res.stderr, res.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.report.json").exists()


def test_checkpoint_metadata_is_read_without_values(ckpt: Path) -> None:
    meta = open_checkpoint(ckpt)
    assert len(meta.shards) >= 3
    assert meta.total_bytes == sum(t.nbytes for t in meta.tensors.values())
    assert meta.tensors["model.embed_tokens.weight"].shape == (VOCAB, 32)


def test_fp16_weight_rule_runs_on_streamed_statistics(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    big = _copy(ckpt, tmp_path / "big")
    target = "model.layers.1.mlp.down_proj.weight"
    shard = big / json.loads((big / "model.safetensors.index.json").read_text())["weight_map"][target]
    tensors = load_file(shard)
    tensors[target] = tensors[target] * 1e7  # |w| far beyond fp16's 65504
    save_file(tensors, str(shard), metadata={"format": "pt"})
    result = amplite.convert(big, precision="fp16", level="O2")
    rules = {r["module"]: r["reason"] for r in result.data["weight_rules"]}
    module = "lm.model.layers.1.mlp.down_proj"
    assert list(rules) == [module] and "weight-overflow" in rules[module]
    assert result.dtypes["model.layers.1.mlp.down_proj.weight"] == torch.float32  # its reader stays FP32
    assert result.dtypes["model.layers.0.mlp.down_proj.weight"] == torch.float16


# --- issue 29: wrong results never pass, outputs say what they store, tools read their own output ---------------

def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def _replace(path: Path, name: str, value: torch.Tensor | None) -> Path:
    from safetensors.torch import load_file, save_file

    shard = _shard_of(path, name)
    tensors = load_file(shard)
    if value is None:
        del tensors[name]
        index = json.loads((path / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


@pytest.mark.parametrize(("name", "make", "match"), [
    ("lm_head.weight", lambda t: t[:250].contiguous(), r"lm_head.weight \(250, 32\) in model-.*\(256, 32\)"),
    ("model.layers.1.self_attn.q_proj.weight", lambda t: t[:, :16].contiguous(), r"q_proj.weight \(32, 16\)"),
    ("model.layers.0.mlp.up_proj.weight", lambda t: t.to(torch.int32), r"up_proj.weight in model-.* is int32"),
    ("lm_head.weight", lambda t: None, r"needs 'lm_head.weight' \(256, 32\), which no shard holds"),
])  # fmt: skip
def test_wrong_weights_exit_2_naming_tensor_and_shard_before_writing(
    ckpt: Path, tmp_path: Path, name: str, make: object, match: str, cli: Cli
) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    from safetensors.torch import load_file

    _replace(bad, name, make(load_file(_shard_of(bad, name))[name]))  # type: ignore[operator]
    import re

    if "250" in match:  # the CLI once (in-process: the same handler): one line, exit 2, even with --no-verify
        res = cli("convert", bad, "-o", tmp_path / "m", "--no-verify")
        assert res.exit_code == 2, res.stdout + res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert re.search(match, res.stderr), res.stderr
    else:
        from amplite.save import convert_to_files

        with pytest.raises(AmpliteError, match=match) as info:
            convert_to_files(bad, output=tmp_path / "m")
        assert info.value.exit_code == 2
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.report.json").exists()


@pytest.fixture(scope="module")
def default_converted(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, list[tuple]]:
    """``convert_to_files(ckpt)`` with the defaults, verified, once for the module: (the saved result, its
    folder, the progress calls it made). The default-options test and the progress test read the same run."""
    from amplite.save import convert_to_files

    out = tmp_path_factory.mktemp("default") / "d"
    seen: list[tuple[str, int, int]] = []
    saved = convert_to_files(ckpt, output=out, progress=lambda *a: seen.append(a))
    return saved, out, seen


def test_default_conversion_stores_low_precision_and_says_what_it_did(ckpt: Path, tmp_path: Path,
                                                                       default_converted: tuple) -> None:
    from safetensors.torch import load_file

    from amplite.save import convert_to_files

    saved, out, _ = default_converted  # the default: fp16, and O2 for a checkpoint
    assert saved.result.data["config"]["level"] == "O2" and saved.exit_code == 0
    state = {k: v for s in out.glob("*.safetensors") for k, v in load_file(s).items()}
    assert {v.dtype for v in state.values()} == {torch.float16}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["amplite"]["storage_bytes_by_dtype"].keys() == {"float16"}
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.float16
    o1 = convert_to_files(ckpt, output=tmp_path / "o1", level="O1", verify=False)
    assert any("stores every weight in its source dtype" in w for w in o1.result.data["warnings"])


def test_a_bf16_source_is_never_up_cast(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from amplite.save import convert_to_files

    src = tmp_path / "bf16"
    transformers.LlamaForCausalLM.from_pretrained(ckpt).to(torch.bfloat16).save_pretrained(src, max_shard_size="40KB")
    convert_to_files(src, output=tmp_path / "o", precision="fp16", level="O1", verify=False)
    state = {k: v for s in (tmp_path / "o").glob("*.safetensors") for k, v in load_file(s).items()}
    assert {v.dtype for v in state.values()} == {torch.bfloat16}  # O1's FP32 plan would double it
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "bfloat16"


def test_pt2_only_output_is_verified_from_the_written_archive(ckpt: Path, tmp_path: Path, cli) -> None:
    res = cli("convert", ckpt, "-o", tmp_path / "model.pt2", "--precision", "bf16",
              "--input", "input_ids:1x5:int64[0,256)")  # in-process (the fresh-process CLI: `converted`)  # fmt: skip
    assert res.exit_code == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "model.report.json").read_text())
    assert report["verification"]["passed"] and report["verification"]["outputs"][0]["sqnr_db"] > 35
    assert not list(tmp_path.glob(".*"))  # no staging left
    ep = torch.export.load(tmp_path / "model.pt2")
    assert ep.module()(input_ids=_ids(2)[:, :5]).shape == (1, 5, VOCAB)  # traced at the --input shape


def test_sigterm_while_writing_leaves_no_staging(ckpt: Path, tmp_path: Path) -> None:
    import os
    import signal

    from amplite.save import convert_to_files

    def progress(step: str, done: int, total: int) -> None:
        if step.startswith("writing") and done:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit):
        convert_to_files(ckpt, output=tmp_path / "o", formats="safetensors,pt2", progress=progress)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_outputs_follow_the_umask(ckpt: Path, tmp_path: Path) -> None:
    import os

    from amplite.save import convert_to_files

    old = os.umask(0o022)
    try:
        convert_to_files(ckpt, output=tmp_path / "o", formats="safetensors,pt2", verify=False)
    finally:
        os.umask(old)
    assert (tmp_path / "o").stat().st_mode & 0o777 == 0o755
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "o").iterdir()} == {0o644}
    assert (tmp_path / "o.pt2").stat().st_mode & 0o777 == 0o644


def test_check_dir_gates_on_the_streamed_conversion(ckpt: Path, tmp_path: Path) -> None:
    from amplite.gate import check

    res = check(ckpt, precision="bf16", junit=tmp_path / "j.xml")
    assert res.exit_code == 0 and res.report.data["verification"]["outputs"][0]["sqnr_db"] > 35
    assert "testcase" in (tmp_path / "j.xml").read_text()
    strict = check(ckpt, precision="bf16", tolerance=["sqnr>=200"])
    assert strict.exit_code == 1 and "sqnr_db>=200" in strict.reasons[0]
    assert not list(ckpt.parent.glob(".amplite-check.*"))
    with pytest.raises(AmpliteError, match=r"--golden do(es)? not apply"):
        check(ckpt, golden=tmp_path / "g")


def test_verification_reports_progress(default_converted: tuple) -> None:
    _, _, seen = default_converted
    verifying = [(d, t) for s, d, t in seen if s == "verifying"]
    assert len(verifying) > 10 and verifying[-1][0] == verifying[-1][1] > 0
    assert [d for d, _ in verifying] == sorted(d for d, _ in verifying)


def test_a_converted_directory_is_read_by_every_command_that_takes_a_directory(ckpt: Path, tmp_path: Path) -> None:
    """The safetensors output is itself a checkpoint directory: inspect, check and convert accept it."""
    from amplite.gate import check
    from amplite.save import convert_to_files

    convert_to_files(ckpt, output=tmp_path / "bf16", precision="bf16", verify=False)
    planned = amplite.convert(tmp_path / "bf16", precision="bf16")  # what `amplite inspect DIR` runs
    assert isinstance(planned, StreamedConversion) and planned.data["plan"]
    assert check(tmp_path / "bf16", precision="bf16").exit_code == 0
    again = convert_to_files(tmp_path / "bf16", output=tmp_path / "again", precision="bf16")
    assert again.exit_code == 0 and again.result.data["weights"]["ratio"] == 1.0  # already bf16: nothing to halve
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"


def test_api_result_saves_like_the_cli_and_says_what_module_to_use(ckpt: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    result = amplite.convert(ckpt, precision="bf16", level="O2")
    assert result.report.data is result.data and result.report.data["config"]["precision"] == "bf16"
    out = result.save(tmp_path / "llama.bf16")
    assert out == tmp_path / "llama.bf16" and (out / "config.json").is_file()
    shard = next(out.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if k.endswith("proj.weight")} == {torch.bfloat16}  # noqa: SIM118
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert next(loaded.model.layers[0].mlp.parameters()).dtype == torch.bfloat16
    with pytest.raises(AmpliteError, match="exists"):  # the CLI's output guard: nothing overwritten
        result.save(out)
    pt2 = result.save(tmp_path / "llama.pt2")
    program = torch.export.load(str(pt2))
    embed = next(v for k, v in program.state_dict.items() if k.endswith("embed_tokens.weight"))
    assert embed.dtype == torch.bfloat16
    with pytest.raises(AmpliteError, match="from_pretrained"):
        result.module()
