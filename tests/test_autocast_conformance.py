"""Conformance with torch's own autocast lists (``torch/testing/_internal/autocast_test_lists.py``).

Every op of the CUDA lists ``torch_fp16``, ``nn_fp16``, ``linalg_fp16`` and ``methods_fp16`` must run in
low precision at O1; every op of ``torch_fp32``, ``nn_fp32`` and ``methods_fp32`` must give results
bit-identical to FP32 at O1 and at O2 (where everything not kept FP32 goes low, so a missing table entry
shows). Each op runs with the list's own arguments (floats upcast to FP32: the model is an FP32 model) in a
tiny module; the ops of one list share one conversion (each in its own submodule, told apart by module
path), which keeps the test fast.

The lists are read without importing torch's test utilities (they need ``expecttest``): the class is cut
out of the file with ``ast`` and executed with ``TEST_WITH_ROCM = False``.
"""

from __future__ import annotations

import ast
import collections
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import amplite
from amplite import op_tables
from amplite.converter.graph_stats import node_compute_dtype
from amplite.passes.graph_utils import cast_dtype, module_path

LOW_LISTS = ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16")
FP32_LISTS = ("torch_fp32", "nn_fp32", "methods_fp32")
#: Entries that cannot run here, with the reason (anything else must pass).
SKIP = {
    "cudnn_convolution": "cuDNN-only op: no CPU kernel, so torch.export cannot trace it on this machine",
    "cudnn_convolution_transpose": "cuDNN-only op: no CPU kernel, so torch.export cannot trace it on this machine",
}
#: The list's einsum entry applies a 4-D equation to 2-D matrices (torch's own test never runs it: it
#: reads the tensors as its skip flag); it is checked with arguments that fit the equation.
EINSUM = ("einsum", ("bkhd,bqhd->bqkh", torch.randn(2, 3, 4, 5), torch.randn(2, 6, 4, 5)), {})


@cache
def autocast_lists() -> Any:
    """``AutocastTestLists("cpu")``, loaded from torch's file without its imports."""
    src = Path(torch.__file__).parent / "testing" / "_internal" / "autocast_test_lists.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AutocastTestLists")
    namespace = {"torch": torch, "collections": collections, "TEST_WITH_ROCM": False}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(src), "exec"), namespace)
    return namespace["AutocastTestLists"]("cpu")


def _entry(raw: tuple) -> tuple[str, tuple, dict]:
    op, args, kwargs = raw[0], raw[1], {}
    if len(raw) == 3 and isinstance(raw[2], dict):
        kwargs = raw[2]
    if op == "einsum":
        return EINSUM
    return op, tuple(args), kwargs


def _function(list_name: str, op: str) -> Any:
    if list_name.startswith("methods"):
        return lambda *a, **k: getattr(a[0], op)(*a[1:], **k)
    namespace = {"nn": torch._C._nn, "linalg": torch._C._linalg}.get(list_name.split("_")[0], torch)
    return getattr(namespace, op)


def _upcast(a: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, a)


class One(nn.Module):
    """Calls one op with a template of its arguments; the template's tensors are this module's inputs."""

    def __init__(self, fn: Any, template: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn, self.template, self.kwargs = fn, template, kwargs

    def forward(self, *tensors: torch.Tensor) -> Any:
        values = iter(tensors)
        args = pytree.tree_map_only(torch.Tensor, lambda _: next(values), self.template)
        return self.fn(*args, **self.kwargs)


class Ops(nn.Module):
    """Every op of some lists, each in submodule ``ops.<i>``; returns their results as one tuple."""

    def __init__(self, cases: list[tuple[str, str, tuple, dict]]) -> None:
        super().__init__()
        self.ops = nn.ModuleList(One(_function(lst, op), args, kw) for lst, op, args, kw in cases)
        self.counts = [sum(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(args))
                       for _, _, args, _ in cases]  # fmt: skip

    def forward(self, *tensors: torch.Tensor) -> tuple:
        out, start = [], 0
        for op, n in zip(self.ops, self.counts, strict=True):
            out.append(op(*tensors[start : start + n]))
            start += n
        return tuple(out)


def _cases(lists: tuple[str, ...]) -> tuple[list[tuple[str, str, tuple, dict]], list[torch.Tensor]]:
    cases, inputs = [], []
    for list_name in lists:
        for raw in getattr(autocast_lists(), list_name):
            op, args, kwargs = _entry(raw)
            if op in SKIP:
                continue
            args = _upcast(args)
            cases.append((list_name, op, args, kwargs))
            inputs += [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
    return cases, inputs


def test_lists_load_and_cover_the_ops() -> None:
    lists = autocast_lists()
    names = {e[0] for lst in (*LOW_LISTS, *FP32_LISTS) for e in getattr(lists, lst)}
    assert {"_convolution", "conv2d", "linear", "softmax", "__matmul__", "__pow__"} <= names
    assert sum(len(getattr(lists, lst)) for lst in (*LOW_LISTS, *FP32_LISTS)) >= 80


@pytest.mark.parametrize("op", sorted(SKIP))
def test_ops_that_cannot_be_traced_here(op: str) -> None:
    pytest.skip(SKIP[op])


def test_low_precision_lists_run_low_at_o1() -> None:
    cases, inputs = _cases(LOW_LISTS)
    model = Ops(cases).eval()
    result = amplite.convert(model, (tuple(inputs), {}), level="O1", verify=False)
    by_module: dict[str, list[torch.fx.Node]] = {}
    for node in result.program.graph.nodes:
        if node.op == "call_function" and cast_dtype(node) is None:
            by_module.setdefault(module_path(node), []).append(node)
    wrong = []
    for i, (list_name, op, _args, _kw) in enumerate(cases):
        nodes = [n for n in by_module.get(f"ops.{i}", []) if op_tables.op_name(n.target) in op_tables.LOW_PRECISION_OPS]
        dtypes = {str(node_compute_dtype(n)).removeprefix("torch.") for n in nodes}
        if dtypes != {"float16"}:
            wrong.append(f"{list_name}:{op} {[op_tables.op_name(n.target) for n in nodes]} {sorted(dtypes)}")
    assert not wrong, wrong  # e.g. the deprecated 12-argument _convolution stayed FP32


def _same(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp32_lists_stay_bit_identical(level: str) -> None:
    cases, inputs = _cases(FP32_LISTS)
    model = Ops(cases).eval()
    result = amplite.convert(model, (tuple(inputs), {}), level=level, verify=False)
    with torch.no_grad():
        want, got = model(*inputs), result.program.module()(*inputs)
    differ = [f"{lst}:{op}" for (lst, op, _, _), w, g in zip(cases, want, got, strict=True) if not _same(w, g)]
    assert not differ, differ
