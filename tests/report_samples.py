"""One schema-valid JSON value per report section, for the typed sections' tests (tests/test_report_typed.py).

Written by hand from amplite/schemas/report.schema.json, with the non-finite encodings ("inf", "nan") and
``null`` values where the schema allows them, so that a round trip has something to lose. The sections a
conversion of the zoo MLP writes are taken from that report instead (see the test's fixture).
"""

from __future__ import annotations

from typing import Any

_OUTPUT = {"name": "out", "shape": [2, 3], "dtype": "float16", "max_abs": 0.01, "mean_abs": 0.001, "max_rel": "inf",
           "cosine": 0.9999, "sqnr_db": 41.5, "mismatch": 0.0, "ref_nonfinite": 0, "out_nonfinite": 0,
           "passed": True, "notes": [], "checks": [{"criterion": "sqnr_db>=40", "value": 41.5, "passed": True}],
           "elements": 6, "compared": 6}  # fmt: skip
_TOL = {"min_sqnr_db": 40.0, "min_cosine": 0.999, "max_mismatch": 0.01, "criteria": ["sqnr_db>=40"]}
_ERR = {"sqnr_db": "inf", "max_abs": 0.0, "rel_l2": 0.0, "new_nonfinite": 0}
_NODE = {"index": 3, "node": "linear", "op": "linear.default", "module": "fc1", "source": "m.py:9", "layer": "fc1",
         "dtype": "float16", "accumulated": _ERR, "isolated": {**_ERR, "sqnr_db": 38.25}, "exact": False,
         "introduces_nonfinite": False, "inherited_nonfinite": False,
         "range": {"max_abs": 70000.0, "overflow": 0.5, "flush_to_zero": 0.0, "subnormal": 0.0}}  # fmt: skip

SAMPLES: dict[str, Any] = {
    "output": {"path": "/tmp/m.pt2", "bytes": 10},
    "outputs": [{"format": "pt2", "path": "/tmp/m.pt2", "bytes": 10},
                {"format": "onnx", "path": "/tmp/m.onnx", "bytes": 12, "opset": 18, "data_path": None}],
    "streaming": {"peak_rss_bytes": 2**20, "largest_shard_bytes": 4096, "shards": 3},
    "weight_rules": [{"module": "model.lm_head", "reason": "range:weight-overflow"}],
    "fp8_checkpoint": {"layout": "vLLM quant_method fp8 (safetensors)", "activation_scheme": "dynamic",
                       "weight_scales": "per-tensor", "fp8_linears": 14, "ignored_layers": ["lm_head"],
                       "calibration": None, "bytes": 1000, "bf16_bytes": 1900, "size_vs_bf16": 0.5263},
    "verification_aoti": {"runtime": "aotinductor", "path": "/tmp/m.pt2", "device": "cpu", "passed": True,
                          "outputs": [_OUTPUT], "seconds": 1.5},
    "verification_onnx": {"runtime": "onnxruntime", "path": "/tmp/m.onnx", "provider": "CPUExecutionProvider",
                          "runnable": False, "not_runnable": "no kernel for X", "caveat": None, "passed": None,
                          "outputs": []},
    "budget": {"tolerance": _TOL, "passed": False, "candidates": 7, "trials": 3, "trial_bound": 16,
               "search": {"trials": 2, "bound": 16},
               "moved_to_fp32": [{"node": "pow_1", "op": None, "module": None, "source": None,
                                  "isolated_sqnr_db": "nan", "to": "float32"}],
               "prune": {"before": 1, "after": 1, "trials": 0, "bound": 0},
               "steps": [{"trial": 0, "kind": "plan", "moved": 0, "passed": False, "worst_sqnr_db": 12.5,
                          "seconds": 0.0},
                         {"trial": 1, "kind": "all", "moved": 7, "passed": False, "worst_sqnr_db": "nan",
                          "seconds": 0.2}],
               "seconds": 1.25, "message": "even with all 7 candidate nodes in FP32 the tolerance is not met"},
    "layerwise": {"batch": 0, "paired_nodes": 5, "unpaired_converted_nodes": ["_to_copy"], "seconds": 0.1,
                  "top_introducers": [_NODE], "layers": [{"layer": "fc1", "nodes": 2, "accumulated_sqnr_db": "inf",
                                                           "isolated_sqnr_db": 38.25, "nonfinite": False}],
                  "decisions": [{"node": "argmax", "op": "argmax.default", "module": None, "source": None,
                                 "elements": 4, "agreement": 0.75}],
                  "nodes": [_NODE]},
    "ranges": {"dtype": "float16", "dtype_max": 65504.0, "nodes": 5, "overflowing_nodes": ["linear"],
               "flushing_nodes": [], "max_abs": 70000.0},
    "gradients": {"loss": "sum of outputs", "reference_loss": 1.5, "converted_loss": "nan", "parameters": 4,
                  "min_sqnr_db": 31.5, "median_sqnr_db": None,
                  "worst": [{"parameter": "fc1.weight", "dtype": "float16", "sqnr_db": 31.5, "max_abs": 0.01,
                             "rel_l2": 0.002, "new_nonfinite": 0}],
                  "nonfinite_parameters": [], "missing_gradients": ["fc2.bias"], "graph": "as converted",
                  "underflow": {"dtype": "float16", "values": 100, "underflow_unscaled": 0.125,
                                "recommended_loss_scale": 1024.0},
                  "passed": True, "seconds": 0.5},
    "golden": {"path": "/tmp/golden", "created": None, "source": {"path": "m.pt2", "format": "pt2"},
               "updated": False, "reference_drift": [{"output": "out", "sqnr_db": "inf"}]},
    "baseline": {"margin_db": 1.0, "regressions": [{"output": "out", "metric": "sqnr_db", "baseline": 50.0,
                                                    "current": 41.5, "limit": 49.0}],
                 "passed": False, "created": None},
    "check": {"name": "mlp", "passed": False, "exit_code": 1, "reasons": ["out: sqnr_db regressed"]},
    "llm": {"cache_dtype": "float16", "prompts": 2, "steps": 4, "prompt_lengths": [5, 7], "token_agreement": 0.875,
            "agreeing_tokens": 7, "first_divergence": [None, 3], "ppl_fp32": 12.5, "ppl_converted": "inf",
            "ppl_delta": "inf", "ppl_tokens": 32, "passed": False,
            "checks": [{"criterion": "token_agreement>=0.9", "value": 0.875, "passed": False}]},
    "training": {"steps": 3, "lr": 0.001, "optimizer": "AdamW", "seed": 0, "loss": "mse",
                 "inputs": "random batches", "batches": 3, "precision": "fp16", "level": "O1", "masters": "fp32",
                 "tolerance": {"train_loss_gap": 0.05}, "log_every": 1, "max_gap": 0.01, "passed": True,
                 "fp32_losses": [1.0, 0.9, 0.8], "amplite_losses": [1.0, 0.91, "nan"],
                 "logged": [{"step": 1, "fp32": 1.0, "amplite": 1.0, "gap": 0.0}],
                 "skipped_steps": [2], "loss_scale_history": [65536.0, 32768.0, 32768.0],
                 "gradient_underflow": [{"parameter": "fc1.weight", "mean_share": 0.25, "max_share": 0.5}],
                 "seconds": {"train": 0.5}},
}  # fmt: skip
