"""One-line descriptions of exceptions: the first line of the message and where to look.

Every one-line error amplite prints for a failure it did not anticipate (an export, a file torch cannot read,
a user's factory that raised) names the exception and the innermost line worth changing: the user's own code,
or a line in an installed package with the user's call that reached it; never torch's or amplite's frames,
nor generated code. No torch import: readers of untrusted files use it too.
"""

from __future__ import annotations

import re
import traceback


def summarize_exception(exc: BaseException) -> str:
    """First line of an exception plus where it was raised (:func:`user_frame`)."""
    where = user_frame(exc)
    return f"{_head(exc)}" + (f" (at {where})" if where else "")


def export_failure(exc: BaseException) -> str:
    """An export failure, its location first: torch's messages run to many lines, and the line is what to fix."""
    where = user_frame(exc)
    return (f"at {where}: " if where else "") + _head(exc)


def _head(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    if len(head) > 240:
        head = head[:237] + "..."
    return f"{type(exc).__name__}: {head}"


#: torch's own frames and generated code (``<string>``: the lambda torch.export wraps the call in; dataclass and
#: namedtuple methods) never hold the line to change; frames of other installed packages (torchvision) do.
_NOT_CODE = ("/torch/", "/amplite/", "/contextlib.py", "/functools.py")
_LIBRARY = ("site-packages", "dist-packages")
_CAUSED_BY = re.compile(r"Caused by: \((?P<file>[^()\s]+\.py):(?P<line>\d+) in \w+\)")


def user_frame(exc: BaseException) -> str:
    """'file:line `code`' of the innermost frame outside torch and generated code, along the exception chain.

    When that frame is in an installed package (torchvision's ``ops/boxes.py``), the package-relative path is
    given and the innermost frame of the user's own code follows (``called from model.py:12``); when no frame
    qualifies, the location torch names in its message (``Caused by: (file.py:103 in fn)``).
    """
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:  # the innermost exception's frames first
        seen.add(id(exc))
        chain.insert(0, exc)
        exc = exc.__cause__ or exc.__context__
    for item in chain:
        every = traceback.extract_tb(item.__traceback__)
        frames = [f for f in every if not f.filename.startswith("<") and not any(s in f.filename for s in _NOT_CODE)]
        if frames:
            where, user = frames[-1], [f for f in frames if not any(s in f.filename for s in _LIBRARY)]
            text = _frame_text(where)
            if user and user[-1] is not where:
                text += f", called from {user[-1].filename}:{user[-1].lineno}"
            # the torch.nn layer that raised below it (BatchNorm(momentum=None) in train mode divides by a counter)
            layer = [f for f in every[every.index(where) + 1 :] if "/torch/nn/" in f.filename]
            if layer:
                text += f", inside {_frame_text(layer[-1])}"
            return text
    for item in chain:
        if m := _CAUSED_BY.search(str(item)):
            return f"{m['file']}:{m['line']}"
    return ""


def _frame_text(frame: traceback.FrameSummary) -> str:
    name = frame.filename
    for marker in _LIBRARY:
        if f"/{marker}/" in name:
            name = name.split(f"/{marker}/", 1)[1]
    return f"{name}:{frame.lineno}" + (f" `{frame.line.strip()}`" if frame.line else "")
