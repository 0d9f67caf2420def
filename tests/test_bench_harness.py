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
    for column in ("| passes / export (≤ 0.25) |", "| torch.autocast | amplite O1 | O1 / autocast | amplite O2 |",
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


def _amp_record(rebuild_key: str, passes: float, whole: float) -> dict:
    """A finished amplite job as the harness saves it, with its cost rounds."""
    timings = {"load": 0.0, "export": 1.0, "calibration": 0.5, "passes": passes, rebuild_key: 0.2, "save_pt2": 0.4}
    return {"status": "ok", "timings": timings | {"verify": 2.0}, "torch_export_s": 1.0, "peak_rss_mb": 900,
            "baseline_rss_mb": 500, "graph": {"nodes_by_dtype": {"float16": 3}, "casts": 2,
                                               "low_precision_flop_share": 0.9},
            "pt2_bytes": 50, "verified": True, "runtime_casts": {"casts": 12},
            "accuracy": {"sqnr_db": 40.0, "nonfinite": 0, "ref_nonfinite": 0},
            "onnx": {"casts": 4, "bytes": 2**20, "checker": "passed", "ort_loads": True,
                     "accuracy": {"sqnr_db": 41.5}},
            "cost": {"repeats": 3, "forward_s": 0.3, "export_s": 1.0, "fp32_save_s": 1.0, "whole_s": whole,
                     "timings": timings, "build_path": "direct" if rebuild_key == "rebuild" else "re-export"}}


def test_render_shows_the_issue_targets_and_keeps_other_sections() -> None:
    from bench.sections import preserved

    base = {"status": "ok", "fp32_pt2_bytes": 100, "fp32": {"casts": 0},
            "autocast": {"fp16": {"casts": 20, "accuracy": {"sqnr_db": 40.2}}}}
    models = {"m": {"description": "d", "jobs": {
        "base": base, "amplite:fp16:O1": _amp_record("rebuild", passes=0.2, whole=2.5),
        "amplite:fp16:O2": _amp_record("reexport", passes=0.6, whole=3.5)}}}
    previous = ("# old\n\n## Models and runs\n\nold table\n\n<!-- appended by bench/bench_big.py -->\n"
                "## Big models (bench/bench_big.py)\n\nbig table\n\n## Training\n\nold training\n\n"
                "## Some other script\n\nits text\n")
    kept = preserved(previous, tables.GENERATED)
    assert kept == ["<!-- appended by bench/bench_big.py -->\n## Big models (bench/bench_big.py)\n\nbig table",
                    "<!-- kept verbatim by bench/harness.py from the previous RESULTS.md (not regenerated by it) "
                    "-->\n## Some other script\n\nits text"]
    md = tables.render({"meta": {"date": "d", "machine": "m", "command": "c", "wall_s": 60.0, "versions": {},
                                 "cuda": None}, "models": models}, kept=kept)
    assert md.endswith(kept[1]) and kept[0] in md and "old table" not in md
    for column in ("| build path |", "| rebuild s |", "| FP32 forward s |", "| FP32 .pt2 save s |",
                   "| passes / export (≤ 0.25) |", "| calibration / forward (≤ 1.5) |",
                   "| whole / (export + FP32 save) (≤ 1.5) |", "| SQNR dB |"):
        assert column in md, column
    cost = [ln for ln in md.splitlines() if ln.startswith("| m | fp16:")][:2]
    # O1 built directly: passes 0.2 / export 1.0 met, calibration 0.5 / forward 0.3 missed, 2.5 / (1 + 1) met
    assert cost[0].startswith("| m | fp16:O1 | direct | 3 |") and "| 0.200 (met) | 1.667 (NOT met) | 1.250 (met) |" \
        in cost[0]
    assert cost[1].startswith("| m | fp16:O2 | re-export | 3 |") and "| 0.600 (NOT met) |" in cost[1]
    # casts: O1 12/20 = 0.6 met, O2 0.6 > 0.5 missed; SQNR O1 40.0 − 40.2 = −0.2 ≥ −0.5 met
    assert "| m | fp16 | 0.6 (yes) | 0.6 (NO) | -0.2 (yes) | NO |" in md
    targets = md.split("## Targets")[1]
    assert "| amplite passes (calibration included) / plain torch.export (worst config) | ≤ 0.25 | 0 | 1 | 0 | NO | " \
           "m (worst: fp16:O2): 0.6 |" in targets
    assert "| conversion w/o verification / (plain torch.export + FP32 .pt2 save) (worst config) | ≤ 1.5 | 0 | 1 |" \
        in targets  # O2: 3.5 / 2.0 = 1.75
    assert "| amplite fp16 ONNX passes onnx.checker, loads and runs in ONNX Runtime | ≥ 1 | 2 | 0 | 0 | yes |" \
        in targets
    assert "| m | amplite fp16:O2 | 4 | 1.0 | – | passed | loads and runs | yes | 41.5 |" in md


def test_full_output_variants_run_the_onnx_jobs_and_a_separate_run_fills_missing_models(tmp_path) -> None:
    from bench.sections import supplement

    assert harness.jobs_of("bert-full", jobs.JOBS) == harness.jobs_of("vit-full", jobs.JOBS) == \
        ["onnx", "amplite:fp16:O2"]  # fmt: skip
    assert harness.jobs_of("gpt2-kv", jobs.JOBS) == jobs.JOBS
    saved = tmp_path / "results-onnx-full.json"
    saved.write_text(json.dumps({"meta": {"date": "then", "command": "python bench/harness.py --models a,b"},
                                 "models": {"a": {"description": "d", "jobs": {"onnx": {"status": "ok"}}},
                                            "b": {"description": "d", "jobs": {"onnx": {"status": "ok"}}}}}))
    extra = supplement(saved, {"a": {"description": "d", "jobs": {"base": {}}}})
    assert extra is not None and list(extra["models"]) == ["b"]  # "a" ran in this run: its own rows win
    assert supplement(saved, {"a": {"jobs": {"x": {}}}, "b": {"jobs": {"x": {}}}}) is None
    newer = supplement(saved, {"a": {"jobs": {"x": {}}}, "b": {"jobs": {"x": {}}}}, date="older")
    assert newer is not None and list(newer["models"]) == ["a", "b"]  # "then" > "older": the newer run's rows
