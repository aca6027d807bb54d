"""One screen for the output of a job's processes.

The trainer writes metric lines to stdout and a tqdm bar to stderr; piped through a launcher
they arrive interleaved, the bar as `\\r`-separated updates with no newline, so a naive echo
glues bars to metric lines and prints empty lines. `Console` splits on both `\\r` and `\\n`,
prints each non-empty line once with its `[prefix]`, and keeps progress bars apart: on a
terminal one live bar line at the bottom (cleared before a line is printed, then redrawn),
elsewhere (a log file, CI) one bar line per 10 % of progress. `TidyLog` writes a process's
log file the same way, so the file reads alike whether the launcher's console is a terminal
(the trainer then draws a live bar) or not.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Optional, TextIO

BAR = re.compile(r"(\d+)%\|.*\|\s*\d+/\d+")  # tqdm's "desc:  40%|####      | 4/10 [...]"


class Console:
    def __init__(self, stream: Optional[TextIO] = None, tty: Optional[bool] = None,
                 prefixed: bool = True) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.prefixed = prefixed
        self._lock = threading.Lock()
        self._partial: dict[str, str] = {}
        self._bar = ""  # the live bar's text (terminal only)
        self._decile: dict[str, int] = {}

    def feed(self, prefix: str, text: str) -> None:
        """Show a chunk of `prefix`'s output (it may end in the middle of a line)."""
        with self._lock:
            pieces = re.split(r"[\r\n]", self._partial.get(prefix, "") + text)
            self._partial[prefix] = pieces.pop()
            for piece in pieces:
                self._show(prefix, piece)
            tail = self._partial[prefix]
            if BAR.search(tail) and tail.rstrip().endswith("]"):  # a whole update: tqdm ends
                # it without a newline, show it now
                self._show(prefix, tail)
                self._partial[prefix] = ""
            self.stream.flush()

    def line(self, text: str) -> None:
        """A line of the launcher's own."""
        with self._lock:
            self._print(text)
            self.stream.flush()

    def _show(self, prefix: str, piece: str) -> None:
        piece = piece.rstrip()
        if not piece.strip():
            return
        bar = BAR.search(piece)
        label = f"[{prefix}] " if self.prefixed else ""
        if bar is None:
            self._print(f"{label}{piece}")
        elif self.tty:
            self._bar = f"{label}{piece.strip()}"
            self.stream.write("\r\033[K" + self._bar)
        else:
            decile = min(int(bar.group(1)) // 10, 10)
            key = f"{prefix}|{piece[:bar.start()].strip()}"
            if decile != self._decile.get(key):
                self._decile[key] = decile
                self._print(f"{label}{piece.strip()}")

    def _print(self, text: str) -> None:
        if self.tty and self._bar:
            self.stream.write("\r\033[K" + text + "\n" + self._bar)
        else:
            self.stream.write(text + "\n")

    def close(self) -> None:
        """Show what came without a final newline; end the live bar's line (the next output
        starts on a fresh line)."""
        with self._lock:
            for prefix, partial in self._partial.items():
                self._show(prefix, partial)
            self._partial.clear()
            if self.tty and self._bar:
                self.stream.write("\n")
                self._bar = ""
            self.stream.flush()


class TidyLog:
    """A process's output as a log file: whole lines, a progress bar as one line per 10 %."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lines = Console(self._file, tty=False, prefixed=False)

    def write(self, text: str) -> None:
        self._lines.feed("", text)

    def close(self) -> None:
        if not self._file.closed:
            self._lines.close()
            self._file.close()
