"""Example inputs: ``--input NAME:SHAPE:DTYPE[lo,hi)`` specs and ``--inputs FILE`` files."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import torch

from amplite.errors import InputSpecError
from amplite.paths import not_a_file
from amplite.reading.input_files import read_input_file

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip

#: Most bytes amplite generates for ``--input`` specs (each, and all random batches together): checked before
#: anything is allocated, so ``--input x:200000x200000:float32`` (160 GB) is one line, not an OOM kill.
MAX_GENERATED_BYTES = 16 << 30

#: Default value range of integer inputs without an explicit ``[lo,hi)``.
DEFAULT_INT_RANGE = (0, 10)

_SPEC = re.compile(
    r"^(?P<name>[A-Za-z_][\w.]*):(?P<shape>[0-9x]*):(?P<dtype>[a-z0-9]+)"
    r"(?:\[(?P<lo>-?[\d.eE+-]+),(?P<hi>-?[\d.eE+-]+)(?P<close>[)\]]))?$"
)

_SPEC_FIX = "write NAME:SHAPE:DTYPE, e.g. x:1x3x224x224:float32 or ids:2x128:int64[0,30522)"


def parse_input_spec(spec: str, generator: torch.Generator) -> tuple[str, torch.Tensor]:
    """Turn one ``--input`` spec into a named, seeded random tensor.

    Floats are standard normal unless a range is given (then uniform); integers are uniform in
    ``[lo, hi)`` (default ``[0, 10)``); bools are fair coin flips.

    Raises:
        InputSpecError: If the spec does not parse or names an unknown dtype.
    """
    m = _SPEC.match(spec.strip())
    if not m:
        raise InputSpecError(f"cannot parse --input {spec!r}", _SPEC_FIX)
    dtype_name = m["dtype"]
    if dtype_name not in DTYPES:
        raise InputSpecError(
            f"unknown dtype {dtype_name!r} in --input {spec!r}", f"use one of {', '.join(sorted(DTYPES))}"
        )
    dtype = DTYPES[dtype_name]
    dims = m["shape"].split("x") if m["shape"] else []
    if any(not d or len(d) > 12 for d in dims):  # int() of 5,000 digits raises; 10^12 elements is beyond any bound
        raise InputSpecError(f"bad shape {m['shape'][:40]!r} in --input {spec[:80]!r}", _SPEC_FIX)
    shape = [int(s) for s in dims]
    if any(s <= 0 for s in shape):
        raise InputSpecError(f"every dimension must be positive in --input {spec!r}", _SPEC_FIX)
    check_generated_bytes(math.prod(shape) * dtype.itemsize, f"--input {spec!r}")
    lo = float(m["lo"]) if m["lo"] is not None else None
    hi = float(m["hi"]) if m["hi"] is not None else None
    if lo is not None and hi is not None and hi <= lo:
        raise InputSpecError(f"empty value range in --input {spec!r}", "make the upper bound larger")
    if dtype.is_floating_point:
        if lo is None:
            t = torch.randn(shape, generator=generator)
        else:
            t = torch.rand(shape, generator=generator) * (hi - lo) + lo
        return m["name"], t.to(dtype)
    if dtype == torch.bool:
        return m["name"], torch.rand(shape, generator=generator) < 0.5
    low, high = (int(lo), int(hi) + (1 if m["close"] == "]" else 0)) if lo is not None else DEFAULT_INT_RANGE
    return m["name"], torch.randint(low, high, shape, generator=generator, dtype=dtype)


def check_generated_bytes(nbytes: int, what: str) -> None:
    """Refuse to generate more than :data:`MAX_GENERATED_BYTES` of inputs for ``what``.

    Raises:
        InputSpecError: Naming the size and the bound.
    """
    if nbytes > MAX_GENERATED_BYTES:
        raise InputSpecError(f"{what} needs {nbytes / 2**30:,.1f} GiB, more than the {MAX_GENERATED_BYTES >> 30} GiB "
                             "amplite generates", "give smaller shapes (or fewer random batches)")  # fmt: skip


def spec_bytes(spec: str) -> int:
    """The bytes one ``--input`` spec generates (0 when it does not parse: parsing it reports that)."""
    m = _SPEC.match(spec.strip())
    if not m or m["dtype"] not in DTYPES or any(len(d) > 12 for d in m["shape"].split("x")):
        return 0
    dims = [int(d) for d in m["shape"].split("x") if d] if m["shape"] else []
    return math.prod(dims) * DTYPES[m["dtype"]].itemsize


def inputs_from_specs(specs: list[str] | tuple[str, ...], seed: int = 0) -> Inputs:
    """Keyword inputs from ``--input`` specs (names are forward()'s parameter names)."""
    for spec in specs:  # each, then all together, before anything is allocated
        check_generated_bytes(spec_bytes(spec), f"--input {spec!r}")
    check_generated_bytes(sum(spec_bytes(s) for s in specs), "the --input specs together")
    generator = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = {}
    for spec in specs:
        name, tensor = parse_input_spec(spec, generator)
        if name in kwargs:
            raise InputSpecError(f"input {name!r} is given twice", "pass each --input name once")
        kwargs[name] = tensor
    return (), kwargs


def load_inputs_file(path: str | Path) -> Inputs:
    """Read example inputs from a file (torch.save with weights_only, .npz or .safetensors).

    A single tensor or a tuple/list becomes positional inputs; a dict becomes keyword inputs, except
    that numpy's positional names (``arr_0``, ``arr_1`` …) become positional.

    Raises:
        InputSpecError: Missing or unreadable file, or content that is not tensors.
    """
    p = Path(path)
    problem = not_a_file(p)
    if problem is not None:
        raise InputSpecError(f"inputs file {str(p)!r} {problem}", "pass an existing file to --inputs")
    data = read_input_file(p)  # every check on untrusted input files: amplite.reading.input_files
    if isinstance(data, torch.Tensor):
        return (data,), {}
    if isinstance(data, (tuple, list)):
        return tuple(data), {}
    if isinstance(data, dict):
        if data and all(re.fullmatch(r"arr_\d+", k) for k in data):
            return tuple(data[f"arr_{i}"] for i in range(len(data))), {}
        return (), dict(data)
    raise InputSpecError(
        f"inputs file {str(p)!r} holds a {type(data).__name__}, not tensors",
        "save a tensor, a tuple/list of tensors or a dict of name -> tensor",
    )


def bind_inputs(model: torch.nn.Module, inputs: Inputs, fix: str | None = None) -> Inputs:
    """Check the inputs against ``model.forward``'s signature.

    Args:
        model: The model.
        inputs: ``(args, kwargs)``.
        fix: The fix to print (default: the CLI's, about ``--input`` specs).

    Raises:
        InputSpecError: Naming forward()'s parameters when the inputs do not bind.
    """
    args, kwargs = inputs
    check_keywords(kwargs)
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return inputs
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        given = ", ".join([f"#{i}" for i in range(len(args))] + list(kwargs)) or "none"
        raise InputSpecError(
            f"the inputs do not fit forward{sig}: {exc} (given: {given})",
            fix or "name each --input after a parameter of forward(), or pass a matching --inputs file",
        ) from None
    return inputs


def check_keywords(kwargs: dict[Any, Any]) -> None:
    """Keyword inputs must be named by strings (a program's sample inputs or a dict may hold an int key).

    Raises:
        InputSpecError: Naming the key.
    """
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise InputSpecError(f"a keyword input is named by a {type(bad[0]).__name__} ({str(bad[0])[:40]!r}), not a "
                             "string", "name keyword inputs after forward()'s parameters")  # fmt: skip


def program_signature(program: Any) -> tuple[list[str], int] | None:
    """The top-level input names of an exported program (or its ``.module()``) and how many are positional.

    The names are ``forward()``'s parameter names that ``torch.export`` recorded (the module call graph's
    ``forward_arg_names``; the unlifted module's codegen carries the same list). None when the program
    does not record them.
    """
    info = getattr(getattr(getattr(program, "graph", None), "_codegen", None), "pytree_info", None)
    if info is not None and not hasattr(program, "graph_signature"):
        names, in_spec = list(info.orig_args), info.in_spec
    else:
        calls = getattr(program, "module_call_graph", None) or []
        sig = calls[0].signature if calls else None
        if sig is None or not sig.forward_arg_names:
            return None
        names, in_spec = list(sig.forward_arg_names), program.call_spec.in_spec
    if in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        return None
    n_pos = in_spec.child(0).num_children
    return (names, n_pos) if len(names) == n_pos + in_spec.child(1).num_children else None


def bind_to_program(program: Any, inputs: Inputs) -> Inputs:
    """``inputs`` rearranged to the calling convention the program was exported with.

    A program exported from ``forward(x)`` called positionally takes ``x`` positionally only (its
    ``.module()`` rejects ``x=`` with "kwarg keyword mismatch"); named inputs (``--input x:4x32:float32``,
    a dict inputs file) are bound to the recorded parameter names, positional or keyword as exported.

    Raises:
        InputSpecError: Naming the program's inputs when ``inputs`` do not bind to them.
    """
    found = program_signature(program)
    if found is None:
        return inputs
    names, n_pos = found
    args, kwargs = inputs
    check_keywords(kwargs)
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    try:
        bound = inspect.Signature(params).bind(*args, **kwargs)
    except TypeError as exc:
        given = ", ".join([f"#{i}" for i in range(len(args))] + list(kwargs)) or "none"
        raise InputSpecError(
            f"the inputs do not fit the program's inputs ({', '.join(names)}): {exc} (given: {given})",
            f"name each --input after one of: {', '.join(names)} (or pass them in that order)",
        ) from None
    values = [bound.arguments[n] for n in names]  # every parameter is required: bind() checked that
    return tuple(values[:n_pos]), dict(zip(names[n_pos:], values[n_pos:], strict=True))


def normalize_inputs(example_inputs: Any) -> Inputs | None:
    """Accept a tensor, a tuple/list (positional), a dict (keyword) or an explicit ``(args, kwargs)``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputSpecError(
        f"example_inputs of type {type(example_inputs).__name__} are not supported",
        "pass a tensor, a tuple of tensors, a dict of name -> tensor, or (args, kwargs)",
    )


def example_inputs(specs: list[str] | tuple[str, ...], inputs_file: str | Path | None) -> Inputs | None:
    """Example inputs from an inputs file and/or ``--input`` specs (specs add keyword inputs).

    Args:
        specs: ``NAME:SHAPE:DTYPE[lo,hi)`` strings (seeded random tensors).
        inputs_file: A ``torch.save`` tensor/tuple/dict, ``.npz`` or ``.safetensors`` file, or None.

    Returns:
        ``(args, kwargs)``, or None when neither is given.
    """
    inputs = load_inputs_file(inputs_file) if inputs_file is not None else None
    if specs:
        _, named = inputs_from_specs(list(specs))
        inputs = ((), named) if inputs is None else (inputs[0], {**inputs[1], **named})
    return inputs
