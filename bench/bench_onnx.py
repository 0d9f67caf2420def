"""ONNX output, amplite vs onnxconverter-common, per fixture: Cast nodes, file size, and whether ORT loads it.

Usage: ``python bench/bench_onnx.py [--precision fp16] [--levels O1,O2] [--models mlp,cnn] [--json OUT]``

amplite: ``amplite.convert(model, precision, level)`` then ``save_onnx`` (Casts counted in the main graph;
fused contractions are off, so there are no function bodies). onnxconverter-common: the FP32 program
(``result.original``) exported with ``torch.onnx.export(dynamo=True)`` defaults, then
``convert_float_to_float16(model, keep_io_types=True)`` (fp16 only: it has no bf16 mode). "loads" means an
ONNX Runtime CPU session could be created. Ratios are amplite / onnxconverter-common, side by side in one run.

Two baselines: "occ" blocks the nodes amplite keeps in FP32 (``node_block_list``, matched by
node names), so both files hold the same FP32 islands and the Cast counts compare like for like;
"occ-d" is onnxconverter-common's default, which runs norms and softmax in fp16 and so needs fewer Casts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx
import torch

import amplite
from amplite.onnx.export import save_onnx
from fixtures.zoo import FIXTURES, make


def ort_loads(path: Path) -> str:
    """``"yes"`` or the first line of ONNX Runtime's refusal."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        return "no: " + str(exc).splitlines()[0][-110:]
    return "yes"


def fp32_nodes(path: Path) -> set[str]:
    """Names of the nodes of an ONNX file that compute in FP32 (float inputs and outputs all FP32)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.output,
                                                                 *model.graph.value_info]}
    types |= {init.name: init.data_type for init in model.graph.initializer}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    names = set()
    for node in model.graph.node:
        if node.op_type in ("Cast", "Constant"):
            continue
        seen = [types.get(v) for v in [*node.input, *node.output] if types.get(v) in floats]
        if seen and all(t == onnx.TensorProto.FLOAT for t in seen):
            names.add(node.name)
    return names


def fp32_export(program: torch.export.ExportedProgram, optimize: bool) -> onnx.ModelProto:
    """The FP32 dynamo export of ``program`` that :func:`occ_baseline` converts."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(program, (), dynamo=True, verbose=False, optimize=optimize).model_proto


def occ_baseline(
    program: torch.export.ExportedProgram, out: Path, keep_fp32: set[str] | None = None,
    fp32: onnx.ModelProto | None = None,
) -> dict:
    """onnxconverter-common's keep_io_types conversion of the FP32 dynamo export of ``program``.

    ``keep_fp32``: ONNX node names to keep in FP32 (``node_block_list``). The FP32 export is then made without
    the exporter's graph optimisation, so node names match amplite's export (which keeps BatchNormalization
    apart from Conv: its FP32 island sits between them). ``fp32``: that export, made already with
    :func:`fp32_export` (``optimize=keep_fp32 is None``), e.g. shared by several levels of one model; it is
    not modified.
    """
    from onnxconverter_common import float16

    if fp32 is None:
        fp32 = fp32_export(program, optimize=keep_fp32 is None)
    else:
        fp32 = onnx.ModelProto.FromString(fp32.SerializeToString())  # the caller's copy stays as it was
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = [n.name for n in fp32.graph.node if n.name in (keep_fp32 or ())]
        low = float16.convert_float_to_float16(fp32, keep_io_types=True, node_block_list=block)
    onnx.save(low, out)
    return {
        "casts": sum(1 for n in low.graph.node if n.op_type == "Cast"),
        "bytes": out.stat().st_size,
        "loads": ort_loads(out),
        "blocked": len(block),
    }


def measure(name: str, precision: str, level: str, tmp: Path) -> dict:
    """One row: amplite's ONNX and (fp16) onnxconverter-common's for fixture ``name``."""
    model, inputs = make(name)
    result = amplite.convert(model, inputs, precision=precision, level=level, verify=False)
    ours = tmp / f"{name}.{precision}.{level}.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        info = save_onnx(result.program, ours, precision=precision)
    row = {"model": name, "level": level, "amplite_casts": info.casts, "amplite_bytes": info.bytes,
           "amplite_loads": ort_loads(ours), "cleanup": info.cleanup}
    if precision == "fp16":
        ours_fp32 = fp32_nodes(ours)
        same = occ_baseline(result.original, tmp / f"{name}.occ.onnx", ours_fp32)
        row["fp32_nodes"] = len(ours_fp32)
        default = occ_baseline(result.original, tmp / f"{name}.occd.onnx")
        row |= {f"occ_{k}": v for k, v in same.items()} | {f"occ_default_{k}": v for k, v in default.items()}
        row["cast_ratio"] = round(info.casts / same["casts"], 3) if same["casts"] else None
        row["size_ratio"] = round(info.bytes / same["bytes"], 3)
    return row


def main() -> None:
    """Run the comparison and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--levels", default="O1,O2")
    ap.add_argument("--models", default=",".join(FIXTURES))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-not-installed notices
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(m, ns.precision, lvl, Path(tmp)) for m in ns.models.split(",") for lvl in ns.levels.split(",")]
    head = (f"{'model':14s} {'lvl':3s} {'casts':>5s} {'occ':>4s} {'ratio':>5s} {'occ-d':>5s} {'KiB':>7s} "
            f"{'occ KiB':>7s} {'occ-d KiB':>9s}  ORT loads: amplite / occ / occ-d")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "occ_casts" not in r:
            print(f"{r['model']:14s} {r['level']:3s} {r['amplite_casts']:5d} {'-':>4} {'-':>5} {'-':>5} "
                  f"{r['amplite_bytes'] / 1024:7.1f} {'-':>7} {'-':>9}  {r['amplite_loads']}")
            continue
        print(
            f"{r['model']:14s} {r['level']:3s} {r['amplite_casts']:5d} {r['occ_casts']:4d} {r['cast_ratio']:5.2f} "
            f"{r['occ_default_casts']:5d} {r['amplite_bytes'] / 1024:7.1f} {r['occ_bytes'] / 1024:7.1f} "
            f"{r['occ_default_bytes'] / 1024:9.1f}  {r['amplite_loads']} / {r['occ_loads']} / {r['occ_default_loads']}"
        )
    print("occ: onnxconverter-common keep_io_types with amplite's FP32 nodes blocked (same islands); occ-d: its "
          "defaults (no FP32 islands: norms and softmax run in fp16). Ratios: amplite / occ.")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
