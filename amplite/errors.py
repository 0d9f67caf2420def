"""User-facing errors.

Every error a user can cause (bad file, bad option, a model torch.export cannot trace) is raised as an
:class:`AmpliteError`. The CLI prints it as one line, ``error: <problem> — fix: <fix>``, and exits 2
without a traceback (unless ``--debug``). Library callers can catch it like any exception.
"""

from __future__ import annotations


class AmpliteError(Exception):
    """A problem with the user's input, with the fix to apply.

    Args:
        problem: What is wrong, naming the offending file, option or operation.
        fix: What the user should do about it.
    """

    exit_code = 2

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem.rstrip(".")
        self.fix = fix.rstrip(".")
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """The message as a single line, problem first and then the fix."""
        text = " ".join(self.problem.split())
        if self.fix:
            text += " — fix: " + " ".join(self.fix.split())
        return text


class LoadError(AmpliteError):
    """The model file cannot be read or is of an unsupported or unsafe kind."""


class InputSpecError(AmpliteError):
    """Example inputs are malformed or do not fit the model."""


class ExportError(AmpliteError):
    """torch.export could not trace the model (or the converted model)."""


class ConfigError(AmpliteError):
    """An option has an invalid value (unknown level, precision, pattern...)."""


class EmitError(AmpliteError):
    """The output could not be written."""


class InternalError(AmpliteError):
    """amplite's own rewrite produced something wrong: a bug in amplite, not in the user's model."""

    exit_code = 3

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(
            problem,
            fix or "this is an amplite bug, not a problem with your model: please report it with the output of "
            "--debug; meanwhile --keep-fp32 on that node or a lower --level avoids it",
        )


class PathError(AmpliteError):
    """The operating system refused a path the user (or a file) named: too long, no permission, no space."""


#: errno -> the fix for an OS refusal of a named path; any other OSError stays an internal error (a missing
#: file is not here: user paths are checked for existence before work, so ENOENT later is amplite's own).
_PATH_FIXES = {
    "ENAMETOOLONG": "use a shorter path (each name at most 255 bytes)",
    "EACCES": "check the permissions of that path",
    "EPERM": "check the permissions of that path",
    "EROFS": "write to a writable file system",
    "ENOSPC": "free disk space or write elsewhere",
    "EDQUOT": "free disk space or write elsewhere",
    "ENOTDIR": "check the path: a part of it is a file, not a directory",
    "EISDIR": "name a file, not a directory",
    "ELOOP": "the path has a symlink loop: name the file itself",
    "EILSEQ": "use a path of valid characters",
}


def path_error(exc: BaseException) -> PathError | None:
    """The exit-2 error for an OS refusal of a named path (``exc`` or what it was raised from), else None."""
    import errno

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.filename is not None:
            fix = _PATH_FIXES.get(errno.errorcode.get(e.errno or 0, ""))
            if fix is not None:
                name = str(e.filename)
                shown = name if len(name) <= 120 else f"{name[:60]}…{name[-40:]} ({len(name)} characters)"
                return PathError(f"cannot use {shown!r}: {e.strerror}", fix)
        e = e.__cause__ or e.__context__
    return None
