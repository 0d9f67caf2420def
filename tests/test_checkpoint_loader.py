"""Issue 44: a converted checkpoint directory is verified as the standard loader (``from_pretrained``) loads it,
the library gates like the CLI, a written directory can be re-checked, and the friction cases are refused or
reported with their true reason. Every checkpoint here is built by code (tiny Llama, sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # dev extra: a missing install fails, it does not skip
from safetensors.torch import load_file, save_file

import amplite
from amplite.errors import AmpliteError
from amplite.save import convert_to_files
from tests.conftest import Cli

VOCAB = 128
INDEX = "model.safetensors.index.json"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


def _llama(path: Path, dtype: torch.dtype = torch.float32, tie: bool = False, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().to(dtype).save_pretrained(path, max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FP32 untied tiny Llama (seed 0), built once: tests that need another variant edit a copy."""
    return _llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / INDEX).read_text())["weight_map"][name]


def _edit(path: Path, name: str, value: torch.Tensor) -> None:
    shard = _shard_of(path, name)
    tensors = load_file(shard)
    tensors[name] = value.contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(5))


# --- item 3: the library runs the generation gate, and .passed agrees with the CLI's exit code ---------------


def test_library_save_runs_the_generation_criteria_and_agrees_with_the_cli(ckpt: Path, tmp_path: Path,
                                                                           cli: Cli) -> None:  # fmt: skip
    tol = ["token_agreement>=0.5", "ppl_delta<=1e-7"]  # ppl_delta cannot hold at bf16: both must say "fail"
    res = amplite.convert(ckpt, precision="bf16", level="O2", tolerance=tol)
    res.save(tmp_path / "lib")
    llm = res.data["llm"]
    assert [(c["criterion"], c["passed"]) for c in llm["checks"]] == [("token_agreement>=0.5", True),
                                                                     ("ppl_delta<=1e-07", False)]  # fmt: skip
    assert res.passed is False
    proc = cli("convert", ckpt, "--precision", "bf16", "--level", "O2", "-o", tmp_path / "cli",
               *[a for t in tol for a in ("--tolerance", t)])  # fmt: skip
    assert proc.exit_code == 1, proc.stdout + proc.stderr
    ok = amplite.convert(ckpt, precision="bf16", level="O2", tolerance=["token_agreement>=0.5"])
    ok.save(tmp_path / "ok")
    assert ok.passed is True and ok.data["llm"]["checks"][0]["passed"] is True


# --- item 8: friction ------------------------------------------------------------------------------------------


def test_a_quantization_config_is_refused_before_writing(ckpt: Path, tmp_path: Path, cli: Cli) -> None:
    src = _copy(ckpt, tmp_path / "q")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (src / "config.json").write_text(json.dumps(cfg))
    proc = cli("convert", src, "-o", tmp_path / "out")
    assert proc.exit_code == 2 and "quantization_config" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_the_index_of_weights_that_are_not_copied_is_not_copied(ckpt: Path, tmp_path: Path) -> None:
    src = _copy(ckpt, tmp_path / "bin")
    (src / "pytorch_model.bin").write_bytes(b"not read")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    (src / "tokenizer_config.json").write_text("{}")
    convert_to_files(src, output=tmp_path / "out", precision="bf16", verify=False)
    out = tmp_path / "out"
    assert (out / "tokenizer_config.json").exists()
    assert not (out / "pytorch_model.bin").exists() and not (out / "pytorch_model.bin.index.json").exists()
    skipped = json.loads((out / "amplite-plan.json").read_text())["not_copied"]
    assert any(s.startswith("pytorch_model.bin.index.json") for s in skipped), skipped


def test_a_bf16_source_at_bf16_o2_is_not_told_to_use_o2(ckpt: Path, tmp_path: Path) -> None:
    src = _llama(tmp_path / "bf16", torch.bfloat16)
    res = amplite.convert(src, precision="bf16", level="O2")
    assert not any("--level O2" in w for w in res.data.get("warnings", [])), res.data["warnings"]
    fp32 = amplite.convert(ckpt, precision="bf16", level="O1")  # still said where it applies (ckpt: the FP32 one)
    assert any("--level O2" in w for w in fp32.data["warnings"])


def test_an_index_naming_the_wrong_shard_is_reported_as_such(ckpt: Path, tmp_path: Path) -> None:
    src = _copy(ckpt, tmp_path / "idx")
    index = json.loads((src / INDEX).read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    held_by = index["weight_map"][name]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != held_by)
    index["weight_map"][name] = other
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(AmpliteError, match=rf"the index names {other} for tensor '{name}', but {held_by} holds it"):
        amplite.convert(src, precision="bf16")


# --- item 1: verification checks what from_pretrained loads ------------------------------------------------------


@pytest.fixture(scope="module")
def overflow(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with one weight beyond fp16's range (|w| = 1e5)."""
    src = _copy(ckpt, tmp_path_factory.mktemp("over") / "big")
    name = "model.layers.1.mlp.down_proj.weight"
    w = load_file(_shard_of(src, name))[name]
    w[0, 0] = 1e5
    _edit(src, name, w)
    return src


def test_a_weight_beyond_fp16_is_refused_for_a_safetensors_output(overflow: Path, tmp_path: Path, cli: Cli) -> None:
    proc = cli("convert", overflow, "--precision", "fp16", "-o", tmp_path / "out")
    assert proc.exit_code == 2, proc.stdout + proc.stderr
    assert "model.layers.1.mlp.down_proj.weight" in proc.stderr and "--precision bf16" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.report.json").exists()
    with pytest.raises(AmpliteError, match="beyond float16's range"):
        amplite.convert(overflow, precision="fp16").save(tmp_path / "lib")
    proc = cli("check", overflow, "--precision", "fp16")  # the gate checks the same output: refused alike
    assert proc.exit_code == 2 and "beyond float16's range" in proc.stderr, proc.stderr
    proc = cli("convert", overflow, "--precision", "fp16", "-o", tmp_path / "m.pt2")  # the .pt2 keeps it FP32
    assert proc.exit_code == 0, proc.stdout + proc.stderr


def test_verification_reads_the_directory_as_from_pretrained_loads_it(overflow: Path, tmp_path: Path) -> None:
    """Written without the guard (the writer alone), the directory stores the wide weight in a float16 config:
    from_pretrained loads inf, and block-wise verification now sees the same and fails."""
    conv = amplite.convert(overflow, precision="fp16", level="O2")
    out = conv.save_safetensors(tmp_path / "raw")
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype="auto")
    assert torch.isinf(loaded.model.layers[1].mlp.down_proj.weight).any()
    section = conv.verify(out)
    assert section["passed"] is False
    assert conv.passed is False


# --- item 2: ties resolved as transformers resolves them ----------------------------------------------------------


def test_a_distinct_stored_head_under_tie_word_embeddings_is_used_as_transformers_does(ckpt: Path,
                                                                                       tmp_path: Path) -> None:
    """config says tie, the shards hold a different lm_head: transformers unties and uses the stored head. The
    safetensors output and the .pt2 must compute that function, and verification must compare against it."""
    src = _copy(ckpt, tmp_path / "tied")  # saved untied: lm_head differs from the embedding
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    ref = transformers.LlamaForCausalLM.from_pretrained(src).eval()
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)  # transformers untied them
    res = amplite.convert(src, precision="bf16", level="O2")
    res.save(tmp_path / "out", format="safetensors,pt2")
    assert res.passed is True
    with torch.no_grad():
        expected = ref(_ids()).logits
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").eval()
        from_dir = loaded(_ids()).logits.float()
        from_pt2 = torch.export.load(tmp_path / "out.pt2").module()(_ids()).float()

    def sqnr(got: torch.Tensor) -> float:
        return float(10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum()))

    assert sqnr(from_dir) > 30 and sqnr(from_pt2) > 30, (sqnr(from_dir), sqnr(from_pt2))


def test_an_equal_stored_twin_stays_tied_and_is_stored_like_its_origin(ckpt: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    src = _copy(ckpt, tmp_path / "twin")
    emb = load_file(_shard_of(src, "model.embed_tokens.weight"))["model.embed_tokens.weight"]
    _edit(src, "lm_head.weight", emb.clone())
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    res = amplite.convert(src, precision="bf16", level="O2")
    assert res.keys.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    res.save(tmp_path / "out")
    shard = _shard_of(tmp_path / "out", "lm_head.weight")
    with safe_open(str(shard), "pt") as fh:
        assert fh.get_tensor("lm_head.weight").dtype == torch.bfloat16  # not left FP32 beside a bf16 embedding


# --- item 5: higher-order ops in forward, in the checkpoint path -------------------------------------------------


def test_a_checkpoint_whose_forward_has_no_grad_and_cond_regions_converts_and_verifies(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's MLP wrapped in a no_grad region and followed by a torch.cond (planted, so that the case does not
    depend on one release's modelling code): the region's ops are converted, the cond's sub-graphs are never
    taken for weights, block-wise verification passes, and the output loads and agrees with the source."""
    from transformers.models.llama import modeling_llama

    mlp = modeling_llama.LlamaMLP.forward

    def with_regions(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = mlp(self, x)
        return torch.cond(y.sum() > 0, lambda t: t * 2.0, lambda t: t * 3.0, (y,))

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", with_regions)
    res = amplite.convert(ckpt, precision="bf16", level="O2")
    downs = {p["dtype"] for p in res.data["plan"] if p["module"].endswith("mlp.down_proj") and "linear" in p["op"]}
    assert downs == {"bfloat16"}  # inside the no_grad region: converted
    res.save(tmp_path / "out", format="safetensors,pt2")
    assert res.passed is True and len(res.data["verification"]["blocks"]) == 2
    ref = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        expected = ref(_ids()).logits
        got = torch.export.load(tmp_path / "out.pt2").module()(_ids()).float()
    assert 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum()) > 30


# --- item 6: families that failed -------------------------------------------------------------------------------


def test_a_config_with_transformers_special_floats_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """Mamba2's time_step_limit (0, inf) is written by transformers as {"__float__": "Infinity"}."""
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                    state_size=8, n_groups=1, expand=2,
                                    time_step_limit=(0.0, float("inf")))  # fmt: skip
    transformers.Mamba2ForCausalLM(cfg).save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert '"__float__": "Infinity"' in (tmp_path / "m" / "config.json").read_text()
    saved = convert_to_files(tmp_path / "m", output=tmp_path / "out", precision="bf16")
    assert saved.exit_code == 0
    assert '"__float__": "Infinity"' in (tmp_path / "out" / "config.json").read_text()  # carried as written
    transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "out")


@pytest.mark.parametrize("name", ["gpt_neo", "recurrent_gemma", "deepseek_v2", "hrm_text"])
def test_families_that_were_refused_or_crashed_now_convert_and_load(name: str, tmp_path: Path) -> None:
    """GPT-Neo: a constant made on meta (no .pt2, the safetensors output converted and verified through
    from_pretrained); RecurrentGemma: a bf16 buffer the reference used to read as FP32 (exit 3); DeepSeek-V2:
    complex rotary (view_as_complex/polar have no bfloat16 kernel: exit 3), now FP32; HRM: a fused
    ``gqkv_proj`` that transformers splits into q/k/v on load (a one-to-many converter: "no shard holds q_proj")."""
    from bench.checkpoint_archs import correct, run_one

    row = run_one(name, "bf16", "O2", tmp_path)
    assert row["exit"] == 0, row
    assert correct(row), row
    pt2 = (tmp_path / f"{name}.bf16.O2.pt2").exists()
    assert pt2 == (name != "gpt_neo"), row["warnings"]


def test_dynamic_ntk_rope_converts_without_a_pt2(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                    "rope_theta": 10000.0})  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "s", max_shard_size="20KB")
    saved = convert_to_files(tmp_path / "s", output=tmp_path / "out", formats="safetensors,pt2", precision="bf16")
    data = saved.result.report.data
    assert saved.exit_code == 0 and not (tmp_path / "out.pt2").exists()
    assert any(w.startswith("no .pt2") for w in data["warnings"])
    assert data["verification"]["mode"].startswith("through from_pretrained") and data["verification"]["passed"]
    with pytest.raises(AmpliteError, match=r"no \.pt2 for this checkpoint"):
        convert_to_files(tmp_path / "s", output=tmp_path / "only.pt2", precision="bf16")


# --- item 4: re-verify an existing converted directory against its source ---------------------------------------


@pytest.fixture(scope="module")
def written(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("written") / "llama.bf16"
    convert_to_files(ckpt, output=out, precision="bf16", level="O2", verify=False)
    return out


@pytest.mark.parametrize("defect", ["none", "transposed", "swapped"])
def test_check_converted_dir_verifies_it_against_its_source(ckpt: Path, written: Path, tmp_path: Path, cli: Cli,
                                                            defect: str) -> None:  # fmt: skip
    out = _copy(written, tmp_path / "out")
    a, b = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    wa, wb = load_file(_shard_of(out, a))[a], load_file(_shard_of(out, b))[b]
    if defect == "transposed":  # square: the shapes still agree, only the numbers can tell
        _edit(out, a, wa.t())
    elif defect == "swapped":
        _edit(out, a, wb)
        _edit(out, b, wa)
    proc = cli("check", ckpt, "--converted", out, "--tolerance", "sqnr>=30", "--tolerance", "token_agreement>=0.8",
               "--report", tmp_path / "r")  # fmt: skip
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert proc.exit_code == (0 if defect == "none" else 1), proc.stdout + proc.stderr
    assert report["config"]["precision"] == "bf16"  # from OUT's config.json
    assert len(report["verification"]["blocks"]) == 2 and "llm" in report  # block-wise and generation checks ran
    sqnr = report["verification"]["outputs"][0]["sqnr_db"]
    assert (sqnr > 35) if defect == "none" else (sqnr < 30), sqnr
    assert not list(out.parent.glob(".amplite-check.*")) and sorted(p.name for p in tmp_path.iterdir()) == ["out", "r"]


def test_check_converted_refuses_what_is_not_a_converted_directory(ckpt: Path, written: Path, tmp_path: Path,
                                                                   cli: Cli) -> None:  # fmt: skip
    out = _copy(written, tmp_path / "out")
    name = "model.layers.1.mlp.up_proj.weight"
    shard = _shard_of(out, name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((out / INDEX).read_text())
    del index["weight_map"][name]
    (out / INDEX).write_text(json.dumps(index))
    proc = cli("check", ckpt, "--converted", out)
    assert proc.exit_code == 2 and name in proc.stderr, proc.stderr
    proc = cli("check", ckpt, "--converted", tmp_path / "nothing-here")
    assert proc.exit_code == 2 and "not a checkpoint directory" in proc.stderr, proc.stderr


# --- item 7: the generation gate on sliding-window models --------------------------------------------------------


def _mistral(path: Path, window: int) -> Path:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=window)  # fmt: skip
    transformers.MistralForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    return path


def test_the_generation_check_is_sized_to_a_sliding_window(tmp_path: Path) -> None:
    """Window 16, prompts of 8: 7 steps (prompt + steps inside the window, where sliding attention is full
    attention) and 15 perplexity tokens per row; it used to crash (exit 3) once the sequence passed the window."""
    src = _mistral(tmp_path / "m", 16)
    saved = convert_to_files(src, output=tmp_path / "out", precision="bf16", tolerance=["token_agreement>=0.5"])
    llm = saved.result.report.data["llm"]
    assert saved.exit_code == 0 and llm["steps"] == 7 and llm["ppl_tokens"] == 2 * 15, llm
    assert llm["token_agreement"] >= 0.5


def test_a_window_shorter_than_the_prompts_is_refused_before_converting(tmp_path: Path, cli: Cli) -> None:
    src = _mistral(tmp_path / "m", 4)
    proc = cli("convert", src, "-o", tmp_path / "out", "--tolerance", "token_agreement>=0.5")
    assert proc.exit_code == 2 and "sliding window" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.report.json").exists()


def test_a_model_transformers_cannot_run_at_the_precision_is_refused_with_that_reason(tmp_path: Path) -> None:
    """XLNet does not trace on meta (verified through from_pretrained) and transformers' own XLNet fails in
    bfloat16 (the naive cast fails alike): exit 2 naming that, not exit 3, and nothing left behind."""
    from bench.checkpoint_archs import run_one

    row = run_one("xlnet", "bf16", "O2", tmp_path)
    assert row["exit"] == 2 and "does not run in bfloat16" in row["error"], row
    assert not (tmp_path / "xlnet.bf16.O2").exists() and not (tmp_path / "xlnet.bf16.O2.pt2").exists()
