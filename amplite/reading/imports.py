"""The modules a .pt2 load imports: those the user names (``--import``) and, for the pytree types an archive's
signature names, only installed copies of :data:`SAFE_AUTO_IMPORT` (importing a module runs its code, so a
name taken from an untrusted file must not pick it; see ``pt2``'s module docstring).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import site
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amplite.errors import LoadError
from amplite.reading.archive import Archive
from amplite.reading.op_allowlist import registered_ops

#: Packages whose modules amplite imports on its own when the archive names one of their pytree types (their
#: import registers the type: transformers' ModelOutput classes). Only installed copies count: a same-named
#: folder in the working directory is never imported on the archive's word.
SAFE_AUTO_IMPORT = ("transformers", "diffusers")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
#: Operators registered when amplite loaded (torch's own, amplite's): a later --import adds the custom ones.
_OPS_AT_IMPORT = registered_ops()



def import_user_modules(modules: Sequence[str]) -> frozenset[str]:
    """Import what the user named with ``--import`` (custom-op libraries, pytree registrations).

    Returns:
        The custom operators (``ns::op``) the user vouches for: those registered since amplite loaded, in a
        namespace torch did not have then, or in a namespace named like a part of an imported module.

    Raises:
        LoadError: A malformed name or an import that fails.
    """
    if modules and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's own packages, as for --model-factory
    for name in modules:
        if not _MODULE.match(name):
            raise LoadError(f"--import {name!r} is not a module name", "write e.g. --import mypkg.ops")
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise LoadError(
                f"--import {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
                "install the package or run from the directory that contains it",
            ) from None
    if not modules:
        return frozenset()
    parts = {part for name in modules for part in name.split(".")}
    known = {op.split("::", 1)[0] for op in _OPS_AT_IMPORT}
    return frozenset(
        op
        for op in registered_ops()
        if op.split("::", 1)[0] in parts or (op not in _OPS_AT_IMPORT and op.split("::", 1)[0] not in known)
    )


def _treespec_types(arch: Archive) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                names.add(node["type"])
            for child in node.get("children_spec") or []:
                visit(child)

    for entry in arch.program_json.get("graph_module", {}).get("module_call_graph", []) or []:
        signature = (entry or {}).get("signature") or {}
        for key in ("in_spec", "out_spec"):
            try:
                spec = json.loads(signature.get(key) or "null")
            except ValueError:
                continue  # torch reports it when it parses the spec
            if isinstance(spec, list) and len(spec) == 2:
                visit(spec[1])
    return names


def register_pytree_types(arch: Archive) -> None:
    """Make the pytree types the program's signature names known (import rule: see the module docstring)."""
    import torch.utils._pytree as pytree

    for name in sorted(_treespec_types(arch)):
        if name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module = name.rpartition(".")[0]
        if _MODULE.match(name) and _safe_to_auto_import(module):
            with contextlib.suppress(Exception):  # the name was the archive's: fall through to the message
                importlib.import_module(module)
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            raise LoadError(
                f"{str(arch.path)!r}: its inputs or outputs use the pytree type {name}, which is not registered "
                "(not a custom-op problem)",
                f"pass --import {module or 'MODULE'} (import_modules=[...]) naming the module that registers it",
            )


def _safe_to_auto_import(module: str) -> bool:
    top = module.split(".", 1)[0]
    if top not in SAFE_AUTO_IMPORT:
        return False
    if top in sys.modules:
        return True
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin:
        return False
    origin = Path(spec.origin).resolve()
    dirs = {*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()}
    installed = [Path(d).resolve() for d in dirs if "site-packages" in d or "dist-packages" in d]
    return any(origin.is_relative_to(d) for d in installed)
