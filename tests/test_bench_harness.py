"""The benchmark harness: cast counting, accuracy, one real (small) run, and failure rows with their text."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from torch import nn

from bench import harness, jobs, tables
from bench.autocast_count import accuracy, count_casts, run
from bench.corpus import CASES, Case, have_transformers


def test_cast_counter_sees_autocast_and_explicit_casts() -> None:
    lin = nn.Linear(8, 4).eval()
    x = torch.randn(2, 8)
    # autocast on CPU casts the input, the weight and the bias of a linear once each
    assert count_casts(lin, ((x,), {}), "bf16") == {"casts": 3, "pairs": {"float32->bfloat16": 3}}
    assert count_casts(lin, ((x,), {}))["casts"] == 0

    class Explicit(nn.Module):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return x.half().float() + ids.float()  # two float casts; int → float is not counted

    got = count_casts(Explicit(), ((x, torch.arange(8)), {}))
    assert got == {"casts": 2, "pairs": {"float16->float32": 1, "float32->float16": 1}}


def test_accuracy_metrics() -> None:
    ref = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    same = accuracy(ref, ref.clone(), logits=True)
    assert same["sqnr_db"] == math.inf and same["max_abs"] == 0 and same["top1"] == 1.0
    noisy = ref + 0.01 * ref.norm() / math.sqrt(ref.numel())
    got = accuracy(ref, noisy, logits=False)
    want = 20 * math.log10(float(ref.double().norm()) / float((ref - noisy).double().norm()))
    assert got["sqnr_db"] == pytest.approx(want, abs=1e-6) and "top1" not in got
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert accuracy(ref, bad, logits=True)["nonfinite"] == 1


def test_harness_run_on_a_fixture(tmp_path) -> None:
    out, js = tmp_path / "RESULTS.md", tmp_path / "results.json"
    harness.main(["--models", "fx-mlp", "--jobs", "base,onnx,amplite:fp16:O2", "--out", str(out), "--json", str(js),
                  "--budget", "0.05"])
    data = json.loads(js.read_text())
    recs = data["models"]["fx-mlp"]["jobs"]
    assert {j: r["status"] for j, r in recs.items()} == {"base": "ok", "onnx": "ok", "amplite:fp16:O2": "ok"}
    amp = recs["amplite:fp16:O2"]
    # the MLP at O2: one cast in, one cast out, weights stored in fp16; autocast casts x, w1, b1, w2, b2
    assert amp["runtime_casts"]["casts"] == amp["graph"]["casts"] == 2
    assert recs["base"]["autocast"]["fp16"]["casts"] == 5
    assert amp["accuracy"]["sqnr_db"] > 50 and amp["accuracy"]["nonfinite"] == 0
    assert amp["peak_rss_mb"] >= amp["baseline_rss_mb"] > 0
    assert amp["onnx"]["casts"] >= 1 and "accuracy" in amp["onnx"]
    assert recs["onnx"]["fp32"]["casts"] == 0 and "accuracy" in recs["onnx"]["fp32"]
    if importlib.util.find_spec("onnxconverter_common"):
        assert recs["onnx"]["occ"]["casts"] >= 1
        assert amp["occ_same"]["casts"] >= 1  # onnxconverter-common keeping amplite's FP32 op types
    else:  # not installed (bench extra): the row carries the import error instead of numbers
        assert "onnxconverter_common" in recs["onnx"]["occ"]["error"]
    md = out.read_text()
    for section in ("## amplite conversion cost", "## Casts executed per forward pass", "## Accuracy against FP32",
                    "## ONNX: Cast nodes, size, ONNX Runtime", "## CPU latency", "## Targets", "## Failures"):
        assert section in md
    for column in ("| passes / export |", "| torch.autocast | amplite O1 | O1 / autocast | amplite O2 |",
                   "| SQNR dB | max abs | top-1 | NaN/Inf |", "| Cast nodes | MiB | size / FP32 |"):
        assert column in md
    assert "| fx-mlp | fp16 | 0 | 5 | not run | – | 2 | 0.40 |" in md
    if importlib.util.find_spec("onnxconverter_common"):
        assert "| onnxconverter-common fp16, FP32 ops of amplite fp16:O2 |" in md
    assert data["meta"]["versions"]["torch"] == torch.__version__
    again = tmp_path / "again.md"  # --render rebuilds the same tables from the JSON alone
    harness.main(["--render", "--json", str(js), "--out", str(again)])
    assert again.read_text() == md


def _untraceable() -> tuple[nn.Module, tuple]:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x  # Python branch on a tensor value: torch.export refuses

    return DataDependent(), ((torch.ones(3),), {})


def test_failed_conversion_keeps_its_row_with_amplite_message(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(CASES, "broken", Case("broken", _untraceable, "untraceable", logits=False,
                                              needs_transformers=False))
    rec = jobs.run_job("broken", "amplite:fp16:O1", budget=0.01)
    assert rec["status"] == "error" and rec["error_kind"] == "amplite"
    assert rec["error"].startswith("torch.export could not trace the model") and "— fix:" in rec["error"]
    timeout = harness.run_in_subprocess("fx-mlp", "base", timeout=0.01, budget=0.01)
    assert timeout["status"] == "timeout" and "did not finish within" in timeout["error"]
    results = {"meta": {"date": "d", "machine": "m", "command": "c", "wall_s": 1.0, "versions": {}, "cuda": None},
               "models": {"broken": {"description": "untraceable", "jobs": {"amplite:fp16:O1": rec, "base": timeout}}}}
    md = tables.render(results)
    rows = [ln for ln in md.splitlines() if ln.startswith("| broken |")]
    # every table with a row for the failed job shows the error text, and so does the failure list
    assert sum("error: amplite: torch.export could not trace the model" in r for r in rows) >= 4
    assert any("| amplite:fp16:O1 | error: amplite: torch.export could not trace" in r for r in rows)
    assert any("timeout: did not finish within" in r for r in rows)


def test_unknown_model_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        harness.parse(["--models", "nope"])
    assert exc.value.code == 2 and "unknown model or job 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(not have_transformers(), reason="transformers is not installed (bench extra)")
def test_decode_step_takes_the_dynamic_cache_without_mutating_it() -> None:
    import transformers
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    from bench.corpus import DecodeStep

    register_dynamic_cache_export_support()
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        cache = lm(input_ids=ids[:, :8], use_cache=True).past_key_values
    inputs = ((), {"input_ids": ids[:, 8:], "attention_mask": torch.ones(1, 9, dtype=torch.long), "cache": cache})
    step = DecodeStep(lm).eval()
    first = run(step, inputs)
    second = run(step, inputs)  # same inputs again: the cache given must not have grown
    assert cache.layers[0].keys.shape[-2] == 8 and first[1].layers[0].keys.shape[-2] == 9
    assert torch.equal(first[0], second[0])
    with torch.no_grad():
        direct = lm(input_ids=ids, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(first[0], direct, rtol=1e-4, atol=1e-4)
    program = torch.export.export(step, (), inputs[1], strict=False)  # the cache is a registered pytree input
    torch.testing.assert_close(program.module()(**inputs[1])[0], first[0])


def _refused_onnx(path) -> None:
    """An ONNX file whose graph output is declared float32 but produced as float16 (what
    onnxconverter-common's keep_io_types=True writes when a graph output is also read inside the graph)."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def test_loadability_is_measured_by_creating_a_session(tmp_path) -> None:
    from bench import onnx_compare as oc

    bad = tmp_path / "bad.onnx"
    _refused_onnx(bad)
    got = oc.load_in_ort(bad)
    assert got["ort_loads"] is False and "output arg (y)" in got["ort_error"] and "float16" in got["ort_error"]
    ran = oc.run_ort(bad, (((torch.ones(2),), {})), torch.ones(2), logits=False, time_it=False)
    assert ran == got  # nothing scored for a file ONNX Runtime refuses
    good = tmp_path / "good.onnx"
    oc.export_fp32(nn.Linear(2, 2).eval(), ((torch.ones(1, 2),), {}), good)
    ok = oc.run_ort(good, ((torch.ones(1, 2),), {}), torch.ones(1, 2), logits=False, time_it=False)
    assert ok["ort_loads"] is True and "session" not in ok and "accuracy" in ok


def test_loadability_section_rows() -> None:
    from bench.tables_onnx import loadability

    refused = {"ort_loads": False, "ort_error": "Fail: Type (tensor(float16)) of output arg (y) of node () does not"}
    models = {
        "bert-full": {"description": "d", "jobs": {
            "onnx": {"status": "ok", "fp32": {"ort_loads": True}, "occ": {"casts": 3, "bytes": 1, **refused}},
            "amplite:fp16:O2": {"status": "ok", "onnx": {"casts": 5, "bytes": 1, "ort_loads": True,
                                                         "accuracy": {"sqnr_db": 61.23}}}}},
        "gpt2-kv": {"description": "d", "jobs": {
            "onnx": {"status": "error", "error": "torch.onnx.export(dynamo=True) failed: SpecViolationError: x"}}},
    }
    md = "\n".join(loadability(models))
    occ = "onnxconverter-common fp16 (keep_io_types=True)"
    assert f"| bert-full | {occ} | no | refused: Fail: Type (tensor(float16))" in md
    assert "| bert-full | amplite fp16:O2 | yes | runs; first output SQNR 61.2 dB |" in md
    assert f"| gpt2-kv | {occ} | – | no file: onnxconverter-common converts " \
           "torch.onnx's FP32 export, which failed (torch.onnx.export(dynamo=True) failed: SpecViolationError" in md
