"""The generation check of a converted checkpoint directory: `amplite convert DIR` / `amplite check DIR` with
token_agreement / ppl_delta criteria (tiny generated Llama, sharded; no downloads)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers  # dev extra: a missing install fails, it does not skip
from safetensors.torch import load_file, save_file

from amplite.errors import AmpliteError, InternalError
from amplite.llm.checkpoint import generation_check, verify_checkpoint
from amplite.report.schema import validate_report
from amplite.verify.criteria import parse_criterion
from tests.conftest import Cli, write_tiny_llama

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", VOCAB, "40KB")


@pytest.fixture(scope="module")
def converted(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Any]:
    """``amplite convert DIR`` through the CLI in-process (the other checkpoint modules run it in a fresh one)."""
    out = tmp_path_factory.mktemp("out") / "llama.fp16"
    proc = Cli()("convert", ckpt, "--precision", "fp16", "--level", "O2", "-o", out,
                 "--tolerance", "token_agreement>=0.95", "--tolerance", "ppl_delta<=0.5%")  # fmt: skip
    report = json.loads(out.with_name(out.name + ".report.json").read_text())  # validated when written (conftest)
    return out, report, proc


def test_convert_dir_reports_and_prints_the_generation_check(converted: tuple) -> None:
    _, report, proc = converted
    assert proc.exit_code == 0, proc.stdout + proc.stderr
    g = report["llm"]
    assert g["prompts"] == 4 and g["steps"] == 32 and g["prompt_lengths"] == [8, 8, 5, 5]
    assert g["token_agreement"] >= 0.95 and g["agreeing_tokens"] == round(g["token_agreement"] * 128)
    assert len(g["first_divergence"]) == 4 and g["ppl_tokens"] == 64
    assert g["ppl_fp32"] == pytest.approx(VOCAB, rel=0.2)  # random weights: about uniform over the vocabulary
    assert 0 <= g["ppl_delta"] <= 0.005 and g["converted_dtype"] == "float16"
    assert [(c["criterion"], c["passed"]) for c in g["checks"]] == [("token_agreement>=0.95", True),
                                                                   ("ppl_delta<=0.005", True)]  # fmt: skip
    assert report["verification"]["passed"] is True and report["streaming"]["peak_rss_bytes"] > 0
    assert "generation vs FP32 (4 prompts x 32 greedy steps" in proc.stdout
    assert "token_agreement>=0.95: pass" in proc.stdout
    validate_report(report)  # the schema knows the llm section: a wrong value in it is refused, naming it
    planted = copy.deepcopy(report)
    planted["llm"]["token_agreement"] = 1.5
    with pytest.raises(InternalError, match=r"llm\.token_agreement"):
        validate_report(planted)


def test_a_corrupted_converted_weight_fails_token_agreement(ckpt: Path, converted: tuple, tmp_path: Path) -> None:
    out, report, _ = converted
    bad = shutil.copytree(out, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = bad / index[name]
    tensors = load_file(shard)
    tensors[name] = tensors[name] * 8  # the planted defect: one projection of the written output scaled
    save_file(tensors, shard, metadata={"format": "pt"})
    criteria = [parse_criterion("token_agreement>=0.95"), parse_criterion("ppl_delta<=0.5%")]
    good = verify_checkpoint(ckpt, out, criteria=criteria, steps=8)
    assert good.passed and good.token_agreement == pytest.approx(report["llm"]["token_agreement"], abs=0.2)
    wrong = verify_checkpoint(ckpt, bad, criteria=criteria, steps=8)
    assert not wrong.passed and wrong.token_agreement < 0.95
    assert [c["passed"] for c in wrong.checks] == [False, False]
    assert any(d is not None for d in wrong.first_divergence)


def test_check_dir_exits_1_naming_the_failed_metric_and_its_value(ckpt: Path, tmp_path: Path, cli: Cli) -> None:
    proc = cli("check", ckpt, "--precision", "bf16", "--tolerance", "token_agreement>=0.5",
               "--tolerance", "ppl_delta<=1e-7", "--report", tmp_path / "r")  # fmt: skip
    assert proc.exit_code == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    g = report["llm"]
    assert g["ppl_delta"] > 1e-7 and g["token_agreement"] >= 0.5
    assert report["check"]["passed"] is False and report["verification"]["passed"] is False
    assert any(r.startswith(f"ppl_delta = {g['ppl_delta']} fails ppl_delta<=1e-07") for r in report["check"]["reasons"])
    assert "ppl_delta<=1e-07: FAIL (got" in proc.stdout and "token_agreement>=0.5: pass" in proc.stdout
    assert not list(ckpt.parent.glob(".amplite-check.*"))


@pytest.mark.parametrize("args, message", [
    (["--tolerance", "token_agreement>=abc"], "cannot parse tolerance 'token_agreement>=abc'"),
    (["--tolerance", "token_agreement"], "has no condition"),
    (["--tolerance", "logits:token_agreement>=0.9"], "is scoped to an output"),
    (["--tolerance", "ppl_delta<=1%", "-o", "x.pt2"], "measured on the safetensors output"),
])  # fmt: skip
def test_malformed_generation_criteria_exit_2_before_writing(
    ckpt: Path, tmp_path: Path, cli: Cli, args: list[str], message: str
) -> None:
    args = [a if a != "x.pt2" else str(tmp_path / "x.pt2") for a in args]
    proc = cli("convert", ckpt, *(["-o", tmp_path / "o"] if "-o" not in args else []), *args)
    assert proc.exit_code == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_an_encoder_is_refused_for_generation_criteria(tmp_path: Path) -> None:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    with pytest.raises(AmpliteError, match="needs a causal LM"):
        generation_check(tmp_path / "bert", ["token_agreement>=0.9"])
    assert generation_check(tmp_path / "bert", ["sqnr>=30"]) is None
