"""Append-only JSONL files with one record per optimizer step (``ledger.jsonl``, ``metrics.jsonl``).

Each record is one JSON object with a step (an int under ``step_key``) written by a single
``O_APPEND`` write and fsynced (``dflash.files.append_line``, never through a symbolic link), so a
crash (or a full disk) can tear only the last line. Reading skips a damaged line anywhere else and
counts it (``damaged_lines``): one bad line never hides the records after it. On resume,
``truncate(step)`` keeps the records of steps up to the resumed checkpoint's and drops the records
of later steps (they will be trained again) and a torn last line; a damaged line before the end is
never used to cut the file: it is moved, with its line number, to ``<file>.damaged`` beside it (so
nothing is lost) and named in a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.files import append_line, atomic_file

log = logging.getLogger(__name__)


class StepLog:
    """One step-indexed JSONL file."""

    def __init__(self, path: Path, step_key: str = "step") -> None:
        self.path = Path(path)
        self.step_key = step_key
        self.damaged_lines: list[int] = []
        """1-based numbers of the damaged lines (before the last) the latest read skipped."""

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (must carry the step key)."""
        if not isinstance(record.get(self.step_key), int | float):
            raise ValueError(f"{self.path.name}: record without a numeric {self.step_key!r}: {record}")
        append_line(self.path, json.dumps(record, sort_keys=True), follow_symlinks=False)

    def _numbered(self) -> Iterator[tuple[int, bytes, dict[str, Any] | None, bool]]:
        """``(line number, raw, record or None, is last)`` for every line, streamed."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            prev: tuple[int, bytes] | None = None
            for n, raw in enumerate(fh, start=1):
                if prev is not None:
                    yield prev[0], prev[1], self._parse(prev[1]), False
                prev = (n, raw)
            if prev is not None:
                yield prev[0], prev[1], self._parse(prev[1]), True

    def records(self) -> Iterator[dict[str, Any]]:
        """The readable records in order; a damaged line is skipped (its number is added to
        ``damaged_lines``), a torn last line ignored."""
        self.damaged_lines = []
        for n, _, rec, last in self._numbered():
            if rec is not None:
                yield rec
            elif not last:
                self.damaged_lines.append(n)

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        if not raw.endswith(b"\n"):
            return None  # a torn last line: the write that made it did not complete
        try:
            rec = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(rec, dict) or not isinstance(rec.get(self.step_key), int | float):
            return None
        return rec

    def truncate(self, step: int) -> int:
        """Keep the readable records of steps <= ``step``; drop later steps and a torn last line;
        move damaged earlier lines to ``<file>.damaged``. Returns the number of lines taken out of
        the file (0: it is left untouched)."""
        if all(rec is not None and rec[self.step_key] <= step for _, _, rec, _ in self._numbered()):
            return 0
        damaged: list[tuple[int, bytes]] = []
        torn = later = kept = 0
        with atomic_file(self.path, "wb") as out:
            for n, raw, rec, last in self._numbered():
                if rec is None and last:
                    torn = 1
                elif rec is None:
                    damaged.append((n, raw))
                elif rec[self.step_key] <= step:
                    out.write(raw)
                    kept += 1
                else:
                    later += 1
        if damaged:
            self._set_aside(damaged)
        dropped = torn + later + len(damaged)
        if dropped:
            log.info(
                "%s: kept %d records up to step %d; took out %d later step(s), %d torn last line, "
                "%d damaged line(s)",
                self.path.name,
                kept,
                step,
                later,
                torn,
                len(damaged),
            )
        return dropped

    def _set_aside(self, damaged: list[tuple[int, bytes]]) -> None:
        """Append the damaged lines, each with its line number, to ``<file>.damaged``."""
        aside = self.path.with_name(self.path.name + ".damaged")
        for n, raw in damaged:
            append_line(
                aside, json.dumps({"line": n, "text": raw.decode(errors="replace")}), follow_symlinks=False
            )
        log.warning(
            "%s: line(s) %s are damaged (not a JSON record with a %r); moved to %s, the records around them kept",
            self.path,
            ", ".join(str(n) for n, _ in damaged),
            self.step_key,
            aside,
        )
