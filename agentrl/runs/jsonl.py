"""JSON Lines as the run folder uses them: appended whole, read back skipping torn lines."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line, written whole and flushed: a killed writer leaves at most one torn last line."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


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

    def _reset(self) -> None:
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
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset:  # rewritten shorter
            self._reset()
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
