"""Names the files of one migrate run import from each other: a codemod must not drop an import another file
reads through this one (``from util import GradScaler`` elsewhere keeps ``util.py``'s import)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

from amplite.migrate._cst import matches_prefix
from amplite.migrate._safety import checked_tree, clear_verdicts, read_source
from amplite.migrate._scan import AMP_PREFIXES


def _module_names(path: Path) -> set[str]:
    """The names other files may import ``path`` as (its last dotted component)."""
    return {path.parent.name if path.name == "__init__.py" else path.stem}


def reexported_names(files: Sequence[Path]) -> dict[Path, dict[str, str]]:
    """For each file, the names other files of the run import from it, with where (``b.py:3``).

    ``from util import GradScaler`` or ``import util`` + ``util.GradScaler`` elsewhere means ``util.py``
    must keep binding ``GradScaler``. Modules are matched by their last name (``pkg.util`` -> ``util.py``),
    which may keep an import too many, never one too few. Files that do not parse are ignored here.
    """
    imported: dict[str, dict[str, str]] = {}  # module's last name -> {name: where}
    clear_verdicts()  # a new run: its files' checks are made here, once
    for path in files:
        try:
            problem, tree = checked_tree(read_source(path))  # the one parse (and check) of this file's scan
        except (OSError, ValueError):
            continue
        if problem is not None or tree is None:  # too deep, or does not parse
            continue
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if matches_prefix(node.module, (*AMP_PREFIXES, "torch")):
                    continue
                for alias in node.names:
                    imported.setdefault(node.module.rsplit(".", 1)[-1], {}).setdefault(
                        alias.name, f"{path}:{node.lineno}"
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if not matches_prefix(alias.name, ("torch", "apex")):
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree) if aliases else ():  # `alias.name` reads only matter for an `import alias`
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = aliases[node.value.id].rsplit(".", 1)[-1]
                imported.setdefault(module, {}).setdefault(node.attr, f"{path}:{node.lineno}")
    keep: dict[Path, dict[str, str]] = {}
    for path in files:
        found: dict[str, str] = {}
        for module in _module_names(path):
            found.update({n: w for n, w in imported.get(module, {}).items() if not w.startswith(f"{path}:")})
        keep[path] = found
    return keep
