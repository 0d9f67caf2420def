"""Load a model from a file, detecting its format from the content (never the extension).

Formats: ``torch.export.save`` archives (.pt2, inspected and loaded without torch's unpickling paths by
:mod:`amplite.reading.pt2`), TorchScript archives, ``torch.save`` state dicts (with a ``--model-factory``),
and whole pickled modules (only with ``trust_pickle``: unpickling runs code). Every model file amplite reads
goes through :func:`load_model`; ``docs/security.md`` says what is checked.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from amplite.describe import summarize_exception
from amplite.errors import InputSpecError, LoadError
from amplite.paths import not_a_file
from amplite.reading.archive import check_zip
from amplite.reading.pickles import pickle_problem, starts_like_pickle
from amplite.reading.pt2 import import_user_modules, load_program

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "weights")


@dataclass
class LoadedModel:
    """A loaded model.

    Attributes:
        kind: ``pt2``, ``state_dict``, ``pickle``, ``torchscript`` or ``module``.
        module: The eager module (None for a .pt2, which only has its program).
        program: The ExportedProgram of a .pt2 (None otherwise).
        example_inputs: Inputs stored in the file (.pt2 only), as ``(args, kwargs)``.
        path: The source file ('' for a live module).
    """

    kind: str
    module: nn.Module | None = None
    program: ExportedProgram | None = None
    example_inputs: Inputs | None = None
    path: str = ""
    scripted: Any = None


def detect_format(path: Path) -> str:
    """``pt2``, ``torchscript``, ``torch_zip`` or ``pickle``, from the file's bytes.

    Raises:
        LoadError: For missing files, directories, truncated archives and unknown content.
    """
    if path.is_dir():
        raise LoadError(f"{str(path)!r} is a directory, not a model file", "pass the model file inside it")
    problem = not_a_file(path)  # a FIFO would block the read below, /dev/zero never ends
    if problem is not None:
        raise LoadError(f"model file {str(path)!r} {problem}", "check the path")
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        names = check_zip(path)  # zip bombs, duplicate or stray entries: before any reader sees the file
        if "archive_format" in names:
            return "pt2"
        if any(n.startswith("code/") for n in names) and "constants.pkl" in names:
            return "torchscript"
        if "data.pkl" in names:
            return "torch_zip"
    elif starts_like_pickle(head):
        return "pickle"
    raise LoadError(
        f"{str(path)!r} is not a model file amplite can read",
        "pass a torch.export .pt2, a TorchScript archive, or a torch.save state dict/module",
    )


def load_model(
    path: str | Path,
    *,
    trust_pickle: bool = False,
    model_factory: str | None = None,
    example_inputs: Inputs | None = None,
    import_modules: Sequence[str] = (),
) -> LoadedModel:
    """Load ``path`` as whatever it contains.

    Args:
        path: The model file.
        trust_pickle: Allow unpickling arbitrary objects (a whole pickled nn.Module, pickled entries of a .pt2).
        model_factory: ``package.module:callable`` building the model for a state dict.
        example_inputs: Needed to convert TorchScript (it has no stored inputs).
        import_modules: Modules to import first (custom-op libraries, pytree type registrations).

    Raises:
        LoadError: With the reason and the fix.
    """
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "pt2":
        program = load_program(p, trust_pickle=trust_pickle, import_modules=import_modules)
        stored = getattr(program, "example_inputs", None)
        return LoadedModel("pt2", program=program, example_inputs=_as_inputs(stored), path=str(p))
    import_user_modules(import_modules)
    if fmt == "torchscript":
        return _load_torchscript(p)
    obj = _safe_load(p, trust_pickle, bare_pickle=fmt == "pickle")
    if isinstance(obj, nn.Module):
        return LoadedModel("pickle", module=obj.eval(), path=str(p))
    state = _find_state_dict(obj)
    if state is None:
        raise LoadError(
            f"{str(p)!r} holds a {type(obj).__name__}, neither a state dict nor a module",
            "save model.state_dict() or the model itself",
        )
    if not model_factory:
        raise LoadError(
            f"{str(p)!r} is a state dict: it has weights but no model code",
            "pass --model-factory package.module:function returning the nn.Module",
        )
    model = build_from_factory(model_factory)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise LoadError(
            f"the state dict does not fit {model_factory}(): {' '.join(str(exc).split())[:300]}",
            "check that the factory builds the architecture the weights came from",
        ) from None
    return LoadedModel("state_dict", module=model.eval(), path=str(p))


def _safe_load(p: Path, trust_pickle: bool, bare_pickle: bool) -> Any:
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # the weights-only reader says the same of a damaged file as of pickled classes: tell them apart
        if bare_pickle and (damage := pickle_problem(p)) is not None:
            raise LoadError(
                f"{str(p)!r} is not a model file amplite can read: a damaged pickle ({damage})",
                "pass a torch.export .pt2, a TorchScript archive, or a torch.save state dict/module",
            ) from None
        if not trust_pickle:
            raise LoadError(
                f"{str(p)!r} contains pickled Python objects ({_unsupported_global(exc)}); unpickling "
                "them runs arbitrary code",
                "pass --trust-pickle (trust_pickle=True) only if you trust the file, or save "
                "model.state_dict() / a torch.export .pt2 instead",
            ) from None
    except Exception as exc:
        raise LoadError(
            f"cannot read {str(p)!r}: {summarize_exception(exc)}", "re-save the model with torch.save"
        ) from exc
    _add_cwd_to_path()  # the pickled classes usually live in the user's project
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise LoadError(
            f"unpickling {str(p)!r} failed: {summarize_exception(exc)}",
            "make the model's classes importable (run from the project directory, set PYTHONPATH)",
        ) from exc


def _unsupported_global(exc: Exception) -> str:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    return f"class {match.group(1)}" if match else "not weights-only"


def _add_cwd_to_path() -> None:
    # Console scripts do not put the working directory on sys.path; `python -m` does. Match that.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _find_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in _STATE_DICT_KEYS:
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
    return None


def build_from_factory(spec: str) -> nn.Module:
    """Call ``package.module:callable`` (importable from the working directory) to build a model.

    Raises:
        LoadError: If the spec is malformed, does not import, or does not return an nn.Module.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise LoadError(f"--model-factory {spec!r} is not module:callable", "write e.g. mypkg.models:build")
    _add_cwd_to_path()
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:
        raise LoadError(
            f"--model-factory {spec!r}: cannot import {mod_name!r} ({type(exc).__name__}: {exc})",
            "run from the directory that contains the package, or add it to PYTHONPATH",
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LoadError(f"--model-factory {spec!r}: {mod_name} has no callable {attr!r}", "check the name")
    try:
        model = factory()
    except Exception as exc:
        raise LoadError(f"--model-factory {spec!r} raised {summarize_exception(exc)}", "fix the factory") from exc
    if not isinstance(model, nn.Module):
        raise LoadError(
            f"--model-factory {spec!r} returned a {type(model).__name__}, not an nn.Module",
            "return the model from the factory",
        )
    return model


def _load_torchscript(p: Path) -> LoadedModel:
    try:
        scripted = torch.jit.load(str(p), map_location="cpu")
    except Exception as exc:
        raise LoadError(f"cannot load TorchScript {str(p)!r}: {summarize_exception(exc)}", _TS_FIX) from exc
    return LoadedModel("torchscript", module=None, path=str(p), scripted=scripted.eval())


_TS_FIX = (
    "re-export from Python with torch.export.save(torch.export.export(model, args), 'model.pt2'), or "
    "save model.state_dict() and pass --model-factory"
)


def torchscript_to_program(scripted: Any, inputs: Inputs) -> ExportedProgram:
    """Convert a TorchScript module with torch's TS→export converter (positional inputs only).

    Raises:
        LoadError: If this torch has no converter or the conversion fails.
    """
    args, kwargs = inputs
    if kwargs:
        args = args + tuple(kwargs.values())  # TorchScript's converter only takes positional inputs
    try:
        from torch._export.converter import TS2EPConverter
    except ImportError:
        raise LoadError("this torch cannot convert TorchScript archives", _TS_FIX) from None
    try:
        return TS2EPConverter(scripted, tuple(args)).convert()
    except Exception as exc:
        raise LoadError(f"converting TorchScript failed: {summarize_exception(exc)}", _TS_FIX) from exc


def _as_inputs(stored: Any) -> Inputs | None:
    if isinstance(stored, tuple) and len(stored) == 2 and isinstance(stored[1], dict):
        return tuple(stored[0]), dict(stored[1])
    return None


def load_any(
    model: Any, *, trust_pickle: bool = False, model_factory: str | None = None, import_modules: Sequence[str] = ()
) -> LoadedModel:
    """Wrap what ``amplite.convert`` was given (a module, a program or a path) as a :class:`LoadedModel`."""
    from amplite.converter.inputs import normalize_inputs

    if not isinstance(model, (str, Path)):
        import_user_modules(import_modules)
    if isinstance(model, ExportedProgram):
        stored = getattr(model, "example_inputs", None)
        return LoadedModel("pt2", program=model, example_inputs=normalize_inputs(stored) if stored else None)
    if isinstance(model, nn.Module):
        return LoadedModel("module", module=model)
    if isinstance(model, (str, Path)):
        return load_model(model, trust_pickle=trust_pickle, model_factory=model_factory, import_modules=import_modules)
    raise InputSpecError(
        f"cannot convert a {type(model).__name__}", "pass an nn.Module, an ExportedProgram or a file path"
    )
