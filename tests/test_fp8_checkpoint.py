"""FP8 checkpoint directories (`amplite convert DIR --precision fp8`): vLLM's layout, scales against the weights and
the calibration activations, read back and verified, a planted wrong scale failing the gate (tiny generated Llama,
sharded; no downloads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # dev extra: a missing install fails, it does not skip
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import amplite
from amplite.checkpoint import checkpoint_to_files
from amplite.checkpoint.check import check_checkpoint
from amplite.errors import ConfigError
from tests import fresh
from tests.conftest import write_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
E4M3_MAX = 448.0


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", VOCAB, "20KB")


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib")
    gen = torch.Generator().manual_seed(3)
    for i in range(2):
        save_file({"input_ids": torch.randint(0, VOCAB, (2, 12), generator=gen)}, str(path / f"b{i}.safetensors"))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return fresh.run([sys.executable, "-m", "amplite", *args], cwd=ROOT, timeout=600,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


@pytest.fixture(scope="module")
def static(ckpt: Path, calib: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("out") / "llama.fp8"
    proc = _run("convert", str(ckpt), "--precision", "fp8", "--calib", str(calib), "-o", str(out),
                "--tolerance", "token_agreement>=0.97", "--tolerance", "ppl_delta<=2%")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    return out, report, proc.stdout


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _from_config(quant: dict) -> dict:
    """vLLM's ``Fp8Config.from_config`` (vllm/model_executor/layers/quantization/fp8.py), re-implemented on its
    documented keys: ``quant_method`` (required, contains "fp8": the checkpoint is FP8-serialized),
    ``activation_scheme`` (required, static|dynamic), ``ignored_layers`` and ``weight_block_size`` (optional; a
    block size needs the dynamic scheme)."""
    method, scheme = quant["quant_method"], quant["activation_scheme"]  # KeyError: vLLM's "Cannot find" error
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"Unsupported activation scheme {scheme}")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or scheme != "dynamic"):
        raise ValueError("block-wise quantization needs 2 dims and the dynamic scheme")
    return {"serialized": "fp8" in method, "scheme": scheme, "ignored": quant.get("ignored_layers") or [],
            "block": block}  # fmt: skip


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def test_layout_is_what_vllm_fp8_reads(static: tuple[Path, dict, str], ckpt: Path) -> None:
    out, report, stdout = static
    config = json.loads((out / "config.json").read_text())
    parsed = _from_config(config["quantization_config"])
    assert parsed == {"serialized": True, "scheme": "static", "ignored": ["model.embed_tokens", "lm_head"],
                      "block": None}  # fmt: skip
    assert config["dtype"] == "bfloat16"  # the compute dtype of everything but the FP8 matrix products
    got = _tensors(out)
    source = _tensors(ckpt)
    for layer in (f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS):
        assert got[f"{layer}.weight"].dtype == torch.float8_e4m3fn
        assert got[f"{layer}.weight"].shape == source[f"{layer}.weight"].shape
        for scale in ("weight_scale", "input_scale"):  # per-tensor FP32 scalars (vLLM's PerTensorScaleParameter)
            assert got[f"{layer}.{scale}"].dtype == torch.float32 and got[f"{layer}.{scale}"].shape == ()
    kept = [n for n, t in got.items() if t.dtype == torch.bfloat16]
    assert sorted(kept) == sorted(n for n in source if "norm" in n or "embed" in n or "lm_head" in n)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got)  # every scale is indexed, next to its weight
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                if name.endswith("_scale"):
                    assert index[name] == index[name.rsplit(".", 1)[0] + ".weight"] == shard.name
    fp8 = report["fp8_checkpoint"]
    assert fp8["activation_scheme"] == "static" and fp8["fp8_linears"] == 14
    assert fp8["calibration"] == {"batches": 2, "tokens": 48}
    written = sum(t.numel() * t.element_size() for t in got.values())
    assert fp8["bytes"] == written and fp8["bf16_bytes"] == sum(t.numel() * 2 for t in source.values())
    assert f"{written / fp8['bf16_bytes']:.3f}x the bf16 checkpoint" in stdout


def test_scales_are_amax_over_448_of_weights_and_calibration_inputs(static: tuple[Path, dict, str], ckpt: Path,
                                                                   calib: Path) -> None:  # fmt: skip
    out, _, _ = static
    got, source = _tensors(out), _tensors(ckpt)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for layer in (f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS):
        w = source[f"{layer}.weight"].float()
        assert float(got[f"{layer}.weight_scale"]) == pytest.approx(float(w.abs().max()) / E4M3_MAX, rel=1e-6)
        # the stored codes are the weight over its scale, rounded to e4m3
        codes = (w / got[f"{layer}.weight_scale"]).to(torch.float8_e4m3fn)
        assert torch.equal(got[f"{layer}.weight"].view(torch.uint8), codes.view(torch.uint8))

        def record(mod: torch.nn.Module, args: tuple, layer: str = layer) -> None:
            amax[layer] = max(amax.get(layer, 0.0), float(args[0].abs().max()))

        hooks.append(model.get_submodule(layer).register_forward_pre_hook(record))
    with torch.no_grad():
        for f in sorted(calib.glob("*.safetensors")):
            model(input_ids=load_file(str(f))["input_ids"])
    for layer, value in amax.items():
        assert float(got[f"{layer}.input_scale"]) == pytest.approx(value / E4M3_MAX, rel=1e-4), layer


def test_read_back_and_verified(static: tuple[Path, dict, str]) -> None:
    _, report, stdout = static
    v = report["verification"]
    assert v["passed"] is True and report["config"]["precision"] == "fp8"
    assert v["outputs"][0]["sqnr_db"] >= 25 and len(v["blocks"]) == 2
    assert all(b["sqnr_db"] >= 25 for b in v["blocks"])
    g = report["llm"]
    assert g["converted_dtype"] == "float8_e4m3fn" and "dequantized" in g["converted"]
    assert g["token_agreement"] >= 0.97 and g["ppl_delta"] <= 0.02
    assert "token_agreement>=0.97: pass" in stdout


def test_planted_double_weight_scale_fails_check(static: tuple[Path, dict, str], ckpt: Path, tmp_path: Path,
                                                 cli) -> None:  # fmt: skip
    out, _, _ = static
    ok, reasons = check_checkpoint(ckpt, converted=out)  # the directory as written passes the same gate
    assert reasons == [] and ok.passed is True and ok.data["config"]["precision"] == "fp8"
    assert ok.data["fp8_checkpoint"]["activation_scheme"] == "static"  # read from the directory checked
    assert ok.data["verification"]["tolerance"]["min_sqnr_db"] == 25.0  # fp8's one default, as for a module
    planted = tmp_path / "planted"
    planted.mkdir()
    for f in out.iterdir():
        if f.is_file():
            (planted / f.name).write_bytes(f.read_bytes())
    name = "model.layers.1.self_attn.o_proj.weight_scale"  # x2: about 10 dB output SQNR against 33 dB
    shard = planted / json.loads((planted / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    # the CLI in-process (the convert above ran it in a fresh process): exit 1 and the report
    bad = cli("check", ckpt, "--converted", planted, "--report", tmp_path / "bad")
    assert bad.exit_code == 1, bad.stdout + bad.stderr
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert report["verification"]["passed"] is False
    blocks = {b["block"]: b["sqnr_db"] for b in report["verification"]["blocks"]}
    good = {b["block"]: b["sqnr_db"] for b in ok.data["verification"]["blocks"]}
    assert blocks["lm.model.layers.0"] == good["lm.model.layers.0"]  # the block before is untouched
    assert blocks["lm.model.layers.1"] < good["lm.model.layers.1"] - 10  # the doubled layer's block is hit


def test_dynamic_without_calibration_api(ckpt: Path, tmp_path: Path) -> None:
    conv = amplite.convert(ckpt, precision="fp8")
    assert conv.data["fp8_checkpoint"]["activation_scheme"] == "dynamic"
    assert conv.data["fp8_checkpoint"]["calibration"] is None
    out = conv.save(tmp_path / "dyn")
    assert conv.passed is True
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert _from_config(quant)["scheme"] == "dynamic"
    got = _tensors(out)
    assert not [n for n in got if n.endswith("input_scale")]
    assert got["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    # the size target: 0.55x of bf16 holds when the linears dominate; here the (bf16) embeddings are a third
    assert conv.data["fp8_checkpoint"]["size_vs_bf16"] == pytest.approx(
        conv.data["fp8_checkpoint"]["bytes"] / conv.data["fp8_checkpoint"]["bf16_bytes"], abs=1e-4)


def test_already_quantized_source_refused(static: tuple[Path, dict, str], tmp_path: Path) -> None:
    out, _, _ = static
    for precision in ("fp8", "bf16"):  # nothing converts a quantized directory: its values are not the weights
        with pytest.raises(ConfigError, match=r"quantization_config .*already quantized") as err:
            checkpoint_to_files(out, output=tmp_path / "again", precision=precision)
        assert err.value.exit_code == 2
    assert not (tmp_path / "again").exists()


def test_fp8_pt2_output_refused_before_writing(ckpt: Path, tmp_path: Path) -> None:
    for output, formats in ((tmp_path / "m.pt2", None), (tmp_path / "d", "safetensors,pt2")):
        with pytest.raises(ConfigError, match="safetensors directory in vLLM's layout"):
            checkpoint_to_files(ckpt, output=output, formats=formats, precision="fp8")
    assert not list(tmp_path.iterdir())


def test_moe_refused_before_export(tmp_path: Path) -> None:
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=64)  # fmt: skip
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "moe", safe_serialization=True)
    with pytest.raises(ConfigError, match=r"mixture-of-experts models \(Mixtral\w+\)"):
        checkpoint_to_files(tmp_path / "moe", output=tmp_path / "out", precision="fp8")
    assert not (tmp_path / "out").exists()
