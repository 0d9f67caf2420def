"""Verification data: batches from a directory, a user's loader, or seeded random inputs.

- ``--data DIR``: every ``.pt``/``.pth`` (``torch.save``, weights only), ``.npz`` and ``.safetensors`` file
  in DIR, in name order, is one batch (same layouts as ``--inputs``).
- ``--data-loader module:function``: ``function()`` returns an iterable of batches (a tensor, a tuple,
  a dict, or ``(args, kwargs)``); at most ``max_batches`` are taken.
- ``random``: seeded random batches, either from ``--input NAME:SHAPE:DTYPE[lo,hi)`` specs (one seed per
  batch) or shaped like the example inputs (floats normal with the example's mean and std, integers uniform
  in the example's [min, max], bools fair coins).

Every batch is checked against the program before it runs (:func:`fit_inputs`), so a batch with another
input name, dtype or shape fails with one line naming the batch and the input.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from amplite.converter.inputs import check_generated_bytes, inputs_from_specs, load_inputs_file, spec_bytes
from amplite.describe import summarize_exception
from amplite.errors import ConfigError, InputSpecError, LoadError
from amplite.paths import inside, not_a_file
from amplite.verify.compare import output_names

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
SUFFIXES = (".pt", ".pth", ".npz", ".safetensors")


def batches_from_dir(path: str | Path, option: str = "--data") -> list[tuple[str, Inputs]]:
    """One batch per data file in ``path`` (name order), labelled with the file name.

    ``option`` names the option in messages (``--data``, ``--calib``).

    Only files inside the directory are read (:func:`amplite.paths.inside`): a data file that is a symlink
    is refused (it could lead anywhere), and so is a FIFO or device with a data suffix (a reader would block
    or never end); sub-directories are not walked.

    Raises:
        InputSpecError: Missing or empty directory, or an unreadable file.
        LoadError: A data file that is a symlink, a FIFO or a device.
    """
    p = Path(path)
    if not p.is_dir():
        raise InputSpecError(
            f"{option} {str(p)!r} is not a directory", "pass a directory of .pt/.npz/.safetensors batches"
        )
    files = []
    for f in sorted(p.iterdir()):
        if f.suffix not in SUFFIXES or (f.is_dir() and not f.is_symlink()):
            continue
        inside(p, f.name, "data file", f"the {option} directory", "copy the file into the directory")
        problem = not_a_file(f)
        if problem is not None:
            raise LoadError(f"{option} file {str(f)!r} {problem}", "keep only batch files in the directory")
        files.append(f)
    if not files:
        raise InputSpecError(
            f"{option} directory {str(p)!r} has no .pt, .pth, .npz or .safetensors files",
            "save one batch per file there (torch.save, numpy.savez or safetensors)",
        )
    return [(f.name, load_inputs_file(f)) for f in files]


def batches_from_loader(spec: str, max_batches: int = 64, option: str = "--data-loader") -> list[tuple[str, Inputs]]:
    """Batches from ``module:function`` (the current directory is importable); ``option`` names the option
    in messages.

    Raises:
        InputSpecError: Bad spec, import failure, a loader that raises, yields nothing or yields non-tensors.
    """
    from amplite.converter.inputs import normalize_inputs

    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise InputSpecError(f"{option} {spec!r} is not module:function", "write e.g. mypkg.data:batches")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
        batches = []
        for i, batch in enumerate(fn()):
            if i >= max_batches:
                break
            batches.append((f"{spec}[{i}]", normalize_inputs(batch)))
    except InputSpecError as exc:
        raise InputSpecError(f"{option} {spec}: {exc.problem}", exc.fix) from exc
    except Exception as exc:
        raise InputSpecError(
            f"{option} {spec} failed: {summarize_exception(exc)}",
            "fix the loader so that it yields tensors, tuples or dicts of tensors",
        ) from exc
    if not batches:
        raise InputSpecError(f"{option} {spec} yielded no batches", "make it yield at least one batch")
    return batches


def is_loader_spec(source: str | Path) -> bool:
    """Whether a calibration source names a ``module:function`` loader rather than a directory of batches."""
    return not (isinstance(source, Path) or Path(source).is_dir() or ":" not in str(source))


def calibration_batches(calibration: Any) -> list[Inputs] | None:
    """The range rules' calibration batches: given (an iterable of batches), read from a directory
    (``--calib DIR``, as ``--data``), or from a ``module:function`` loader (``--calib-loader``)."""
    from amplite.converter.inputs import normalize_inputs

    if calibration is None:
        return None
    if isinstance(calibration, (str, Path)):
        if not is_loader_spec(calibration):
            return [b for _, b in batches_from_dir(calibration, option="--calib")]
        return [b for _, b in batches_from_loader(str(calibration), option="--calib-loader")]
    return [b for b in map(normalize_inputs, calibration) if b is not None]


def random_batches(
    example: Inputs | None, n: int, *, specs: Sequence[str] = (), seed: int = 0
) -> list[tuple[str, Inputs]]:
    """``n`` seeded random batches from ``--input`` specs, else shaped like ``example``.

    Raises:
        InputSpecError: When there is neither a spec nor an example to copy shapes from.
    """
    if specs:
        check_generated_bytes(n * sum(spec_bytes(s) for s in specs), f"{n} random batches of --input")
        return [(f"random[{i}]", inputs_from_specs(list(specs), seed=seed + i)) for i in range(n)]
    if example is None:
        raise InputSpecError("random batches need shapes", "pass --input NAME:SHAPE:DTYPE or example inputs")
    per_batch = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor))
    check_generated_bytes(n * per_batch, f"{n} random batches shaped like the example inputs")
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        out.append((f"random[{i}]", pytree.tree_map(lambda t, g=g: _like(t, g), example)))
    return out


def _like(t: Any, g: torch.Generator) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype.is_floating_point:
        x = t.detach().double()
        std = float(x.std()) if t.numel() > 1 else 1.0
        return (torch.randn(t.shape, generator=g, dtype=torch.float64) * (std or 1.0) + float(x.mean())).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=g) < 0.5
    lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
    return torch.randint(lo, hi + 1, t.shape, generator=g, dtype=t.dtype)


def fit_inputs(program: ExportedProgram | torch.nn.Module, batch: Inputs, where: str, fix: str = "") -> Inputs:
    """``batch`` bound to the program's inputs: checked for names, dtypes and static sizes, float inputs
    cast to the dtype the program takes (low-precision I/O), as ``(args, kwargs)`` in the program's order.

    Args:
        program: An ExportedProgram or its ``.module()``.
        batch: ``(args, kwargs)``.
        where: What the batch is, for messages (``batch 3 (x.pt)``).
        fix: The fix to suggest instead of the default.

    Raises:
        InputSpecError: Naming the input that does not fit.
    """
    gm = program.module() if isinstance(program, ExportedProgram) else program
    info = gm.graph._codegen.pytree_info  # type: ignore[attr-defined]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args, kwargs = batch
    first = info.in_spec.child(0) if hasattr(info.in_spec, "child") else info.in_spec.children_specs[0]
    n_pos = first.num_children
    params = list(info.orig_args)
    try:
        bound = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]).bind(
            *args, **kwargs
        )
    except TypeError as exc:
        given = ", ".join([f"#{i}" for i in range(len(args))] + list(kwargs)) or "none"
        raise InputSpecError(
            f"{where} does not fit the model's inputs ({', '.join(params)}): {exc} (given: {given})",
            fix or "give batches with the same input names as the example inputs",
        ) from None
    values = [bound.arguments.get(p) for p in params]
    canonical = (tuple(values[:n_pos]), dict(zip(params[n_pos:], values[n_pos:], strict=True)))
    try:
        flat, spec = pytree.tree_flatten(canonical)
        if spec != info.in_spec:
            raise ValueError(f"structure {spec} differs from {info.in_spec}")
    except ValueError as exc:
        problem = f"{where} is structured differently from the example inputs: {exc}"
        fix = fix or "give batches laid out as the example inputs (tensor, tuple or dict)"
        raise InputSpecError(problem, fix) from None
    names = [p.name for p in placeholders]
    fitted = []
    for name, value, ph in zip(names, flat, placeholders, strict=True):
        want = ph.meta.get("val")
        if not isinstance(want, torch.Tensor) or not isinstance(value, torch.Tensor):
            fitted.append(value)
            continue
        if value.dtype != want.dtype and not (value.dtype.is_floating_point and want.dtype.is_floating_point):
            raise InputSpecError(f"{where}: input {name!r} is {_dt(value)}, the model takes {_dt(want)}",
                                 fix or f"save input {name!r} as {_dt(want)} in the batches")  # fmt: skip
        sizes = [s if isinstance(s, int) else None for s in want.shape]
        if value.dim() != len(sizes) or any(s is not None and s != v for s, v in zip(sizes, value.shape, strict=True)):
            shown = [s if s is not None else "*" for s in sizes]
            raise InputSpecError(
                f"{where}: input {name!r} has shape {list(value.shape)}, the model takes {shown}",
                fix
                or "give batches shaped like the example inputs (convert with --dynamic-batch for other batch sizes)",
            )
        fitted.append(value.to(want.dtype) if value.dtype != want.dtype else value)
    return pytree.tree_unflatten(fitted, info.in_spec)


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def select_batches(
    example: Inputs | None, data: Any, data_loader: str | None, random: int, specs: Sequence[str], max_batches: int
) -> list[tuple[str, Inputs]]:
    if data is not None and data_loader is not None:
        raise ConfigError("--data and --data-loader are both given", "pass one source of batches")
    if max_batches < 1:  # [:0] verified nothing and [:-1] dropped the last batch, silently
        raise ConfigError(f"--max-batches {max_batches} must be at least 1",
                          "pass how many batches to verify on at most, e.g. --max-batches 64")  # fmt: skip
    if data is not None:
        return batches_from_dir(data)[:max_batches]
    if data_loader is not None:
        return batches_from_loader(data_loader, max_batches)
    if random:
        if not 0 < random <= max_batches:  # a count from the command line: bounded before anything is built
            what = f"more than --max-batches {max_batches}" if random > 0 else "negative"
            raise ConfigError(f"--random-batches {random} is {what}",
                              "pass between 1 and --max-batches random batches (or raise --max-batches)")  # fmt: skip
        return random_batches(example, random, specs=specs)
    if example is None:
        raise InputSpecError("no inputs to verify on", "pass --input, --inputs, --data, --data-loader or --golden")
    return [("example inputs", example)]


def run_batch(model: torch.nn.Module, inputs: Inputs, where: str, what: str) -> Any:
    """Run ``model`` on one batch; a failure is the user's batch, reported in one line."""
    try:
        with torch.no_grad():
            return model(*inputs[0], **inputs[1])
    except Exception as exc:
        raise InputSpecError(
            f"{where} does not run through {what}: {summarize_exception(exc)}",
            "give batches shaped like the example inputs",
        ) from exc


def refuse_nan_reference(ref_out: Any, where: str, from_golden: bool) -> None:
    """Refuse to verify against a reference output with NaN (it would only be a fake pass)."""
    for name, leaf in zip(output_names(ref_out), pytree.tree_leaves(ref_out), strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and bool(torch.isnan(leaf).any()):
            what = "the golden reference" if from_golden else "the FP32 model"
            raise InputSpecError(
                f"{what} output {name} has {int(torch.isnan(leaf).sum())} NaN values on {where}: "
                "there is nothing to verify against",
                "fix the FP32 model or these inputs (a reference must be finite), then re-run",
            )


def describe(gold: Any, data: Any, loader: str | None, random: int, n: int) -> str:
    """What the batches were, for the report."""
    if gold:
        return f"golden directory {gold.path} ({n} batches)"
    if data is not None:
        return f"data directory {data} ({n} batches)"
    if loader:
        return f"data loader {loader} ({n} batches)"
    return f"{n} seeded random batches" if random else "example inputs"
