"""JSON Lines as the run folder uses them: appended whole, read back skipping torn lines."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line, written whole and flushed: a killed writer leaves at most one torn last line."""
    append_lines(path, [json.dumps(row)])


def append_lines(path: Path, lines: Sequence[str]) -> None:
    """`lines` (each without its newline) appended in one write and flushed, after a torn last line if a killed
    writer left one (glued to it, the first would be unreadable too)."""
    data = "".join(line + "\n" for line in lines).encode()
    with open(path, "a+b") as f:  # appends go to the end wherever the file was read
        f.write(b"\n" + data if _ends_mid_line(f) else data)
        f.flush()


def _ends_mid_line(f: BinaryIO) -> bool:
    end = f.seek(0, os.SEEK_END)
    if not end:
        return False
    f.seek(end - 1)
    return f.read(1) != b"\n"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every readable line; a torn or corrupt line (a killed run) is skipped with a warning."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped (a run killed mid-write?)", path, n)
    return rows


class JsonlTail:
    """A JSONL file read incrementally: `rows()` returns every readable line, re-reading only what was appended.

    A last line without its newline is left for the next read (the writer may be mid-line); if it
    is still there later it is reported. A file that shrank (a resume truncating its logs) is read anew.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # the viewer answers requests from a thread pool
        self._reset()

    def _reset(self, file: tuple[int, int] | None = None) -> None:
        self._file = file  # (device, inode) of what was read: a file replaced by another is read anew
        self._rows: list[dict[str, Any]] = []
        self._offset = 0
        self._line = 0
        self._bad: list[str] = []
        self._torn: str | None = None

    def rows(self) -> list[dict[str, Any]]:
        self._read()
        return self._rows

    @property
    def warnings(self) -> list[str]:
        self._read()
        return self._bad + ([self._torn] if self._torn else [])

    def _read(self) -> None:
        with self._lock:
            self._read_new()

    def _read_new(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        size, file = stat.st_size, (stat.st_dev, stat.st_ino)
        # rewritten shorter, or replaced (a resume's `RunDir.truncate_logs`, whose file may have grown past the
        # offset since: read from there, it would be the old rows and a torn piece of a new one)
        if size < self._offset or file != self._file:
            self._reset(file)
        if size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1
        for raw in data[:end].splitlines():
            self._line += 1
            if not raw.strip():
                continue
            try:
                self._rows.append(json.loads(raw))
            except ValueError:
                self._bad.append(f"{self.path.name} line {self._line}: unreadable, skipped ({raw[:60]!r})")
        self._offset += end
        rest = data[end:]
        self._torn = (
            f"{self.path.name}: the last line is incomplete ({len(rest)} bytes; the run is writing it, or was "
            "killed mid-write)"
            if rest.strip()
            else None
        )
