"""Batch progress: a rich display on a terminal (overall bar with ETA, one line per running model), plain
lines otherwise (CI logs, pipes), or nothing."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO

from amplite.escape import console as safe_console
from amplite.escape import terminal

_STYLE = {"ok": "green", "unverified": "yellow", "verify_failed": "yellow", "cancelled": "dim"}


class Progress(Protocol):
    """What the runner reports to."""

    def start(self, total: int) -> None:
        """The batch starts with ``total`` models."""

    def started(self, name: str) -> None:
        """A model's worker started."""

    def finished(self, row: dict[str, Any]) -> None:
        """A model finished (its summary row)."""

    def close(self) -> None:
        """The batch ended (also on Ctrl-C)."""


class NullProgress:
    """Reports nothing."""

    def start(self, total: int) -> None:
        pass

    def started(self, name: str) -> None:
        pass

    def finished(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _line(row: dict[str, Any]) -> str:
    secs = f"{row['seconds']:.1f}s" if row.get("seconds") is not None else ""
    tail = " (resumed)" if row.get("resumed") else (f"  {row['error']}" if row.get("error") else "")
    return terminal(f"{row['status']:<13} {row['name']}  {secs}{tail}")


class PlainProgress:
    """One line per finished model, ``[done/total] status name time error``, for non-terminals."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = self.done = 0
        self.t0 = time.perf_counter()

    def start(self, total: int) -> None:
        self.total, self.t0 = total, time.perf_counter()
        print(f"amplite batch: {total} model(s)", file=self.stream, flush=True)

    def started(self, name: str) -> None:
        pass  # plain logs stay one line per model

    def finished(self, row: dict[str, Any]) -> None:
        self.done += 1
        width = len(str(self.total))
        print(f"[{self.done:>{width}}/{self.total}] {_line(row)}", file=self.stream, flush=True)

    def close(self) -> None:
        print(
            f"done: {self.done}/{self.total} in {time.perf_counter() - self.t0:.1f}s",
            file=self.stream,
            flush=True,
        )


class RichProgress:
    """A live rich display: the overall bar with ETA above one spinner line (with elapsed time) per running
    model; a line is printed above the display for each finished one."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Group
        from rich.live import Live
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console or safe_console(highlight=False)
        self.bar = Progress(
            TextColumn("[bold]batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.models = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console
        )
        self.live = Live(Group(self.bar, self.models), console=self.console, refresh_per_second=8)
        self.overall: Any = None
        self.running: dict[str, Any] = {}

    def start(self, total: int) -> None:
        self.overall = self.bar.add_task("batch", total=total)
        self.live.start()

    def started(self, name: str) -> None:
        from rich.markup import escape

        if name not in self.running:
            self.running[name] = self.models.add_task(escape(name), total=None)  # the column reads markup

    def finished(self, row: dict[str, Any]) -> None:
        from rich.text import Text

        task = self.running.pop(row["name"], None)
        if task is not None:
            self.models.remove_task(task)
        self.live.console.print(Text(_line(row), style=_STYLE.get(row["status"], "red")), soft_wrap=True)
        self.bar.advance(self.overall)

    def close(self) -> None:
        for task in self.running.values():
            self.models.remove_task(task)
        self.running.clear()
        self.live.stop()


def make_progress(kind: bool | str | Progress | None) -> Progress:
    """``True``/``"auto"``: rich on a terminal, plain lines otherwise; ``"plain"``, ``"rich"``; falsy: none;
    or any object with the :class:`Progress` methods."""
    if not kind:
        return NullProgress()
    if not isinstance(kind, (bool, str)):
        return kind
    if kind == "rich" or (kind in (True, "auto") and sys.stdout.isatty()):
        return RichProgress()
    return PlainProgress()
