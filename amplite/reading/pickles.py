"""Whether a file that starts like a pickle is one, read without unpickling anything.

``torch.load(weights_only=True)`` answers a damaged file and a file of pickled classes with the same
``UnpicklingError``; only the second is fixed by ``--trust-pickle``. :func:`pickle_problem` walks the opcodes
of the file's first pickle with :func:`pickletools.genops` (a disassembler: nothing is imported or called)
over at most ``limit`` bytes held in memory, so a hostile length field cannot make it allocate more.
"""

from __future__ import annotations

import io
import pickletools
from pathlib import Path

#: The pickle protocols ``torch.save`` and ``pickle`` write (PROTO's argument).
PROTOCOLS = range(2, 6)
#: How much of the file the opcode walk reads: a ``torch.save`` file's first pickle is its magic number
#: (tens of bytes); a plain pickle that is longer is given the benefit of the doubt.
LIMIT = 1 << 20


def starts_like_pickle(head: bytes) -> bool:
    """Whether ``head`` (the file's first bytes) is a pickle's PROTO opcode with a protocol ``torch.save`` writes."""
    return len(head) >= 2 and head[0] == 0x80 and head[1] in PROTOCOLS


def pickle_problem(path: Path, limit: int = LIMIT) -> str | None:
    """Why ``path`` is not a well-formed pickle (its first one, up to ``limit`` bytes), or None.

    Returns:
        None when its first pickle's opcodes are valid up to STOP, or run past ``limit`` bytes without an
        error; else the disassembler's reason (``invalid opcode``, a truncated argument, no STOP).
    """
    with path.open("rb") as f:
        data = f.read(limit)
    if not starts_like_pickle(data):
        return f"it does not start with a pickle protocol header (starts {data[:2].hex() or 'empty'})"
    stream = io.BytesIO(data)
    try:
        for opcode, _arg, _pos in pickletools.genops(stream):
            if opcode.name == "STOP":
                return None
    except ValueError as exc:
        if len(data) == limit and stream.tell() == limit:  # ran out of what was read, not of the file
            return None
        return " ".join(str(exc).split())[:120]
    return None
