"""The op tables are data; every entry must exist in the installed torch."""

from __future__ import annotations

import torch

from amplite import op_tables


def test_every_entry_resolves_in_installed_torch() -> None:
    missing = [e for e in op_tables.all_entries() if op_tables.resolve(e) is None]
    assert missing == []


def test_fp32_list_covers_the_required_families() -> None:
    for op in (
        "sum.dim_IntList",
        "mean.dim",
        "var.correction",
        "std.correction",
        "prod.default",
        "cumsum.default",
        "cumprod.default",
        "logsumexp.default",
        "linalg_vector_norm.default",
    ):
        assert op_tables.fp32_reason(op) == "reduction", op
    for op in ("softmax.int", "log_softmax.int"):
        assert op_tables.fp32_reason(op) == "softmax"
    for op in ("layer_norm.default", "group_norm.default", "batch_norm.default", "rms_norm.default"):
        assert op_tables.fp32_reason(op) == "norm"
    for op in ("cross_entropy_loss.default", "mse_loss.default", "nll_loss.default"):
        assert op_tables.fp32_reason(op) == "loss"
    for op in ("exp.default", "log.default", "pow.Tensor_Scalar", "rsqrt.default"):
        assert op_tables.fp32_reason(op) == "transcendental"


def test_tables_do_not_overlap() -> None:
    low = set(op_tables.LOW_PRECISION_OPS)
    fp32 = {op for ops in op_tables.FP32_OPS.values() for op in ops}
    assert not low & fp32


def test_op_name_round_trips() -> None:
    assert op_tables.op_name(torch.ops.aten.softmax.int) == "softmax.int"
    assert op_tables.resolve("softmax.int") is torch.ops.aten.softmax.int
    assert op_tables.op_name(len) is None
