"""Append-only JSONL files with one record per optimizer step (``ledger.jsonl``, ``metrics.jsonl``).

Each record is one JSON object with a ``"step"`` (int) written by a single ``O_APPEND`` write and
fsynced (``dflash.files.append_line``), so a crash (or a full disk) can tear only the last line.
On resume, ``truncate(step)`` keeps the records of steps up to the resumed checkpoint's and drops
the rest: records of steps that were trained after that checkpoint (they will be trained again)
and a torn or unreadable tail. The kept part is rewritten atomically, and what was dropped is
logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.files import append_line, atomic_write

log = logging.getLogger(__name__)


class StepLog:
    """One step-indexed JSONL file."""

    def __init__(self, path: Path, step_key: str = "step") -> None:
        self.path = Path(path)
        self.step_key = step_key

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (must carry the step key)."""
        if not isinstance(record.get(self.step_key), int | float):
            raise ValueError(f"{self.path.name}: record without a numeric {self.step_key!r}: {record}")
        append_line(self.path, json.dumps(record, sort_keys=True))

    def records(self) -> Iterator[dict[str, Any]]:
        """The readable records in order; stops at the first torn or unreadable line."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            for raw in fh:
                rec = self._parse(raw)
                if rec is None:
                    return
                yield rec

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
        """Keep the records of steps <= ``step`` that precede the first bad line; return how many
        lines were dropped (0: the file is left untouched)."""
        if not self.path.exists():
            return 0
        lines = self.path.read_bytes().splitlines(keepends=True)
        keep: list[bytes] = []
        torn = None
        for i, raw in enumerate(lines):
            rec = self._parse(raw)
            if rec is None:
                torn = i + 1
                break
            if rec[self.step_key] <= step:
                keep.append(raw)
        dropped = len(lines) - len(keep)
        if dropped:
            atomic_write(self.path, b"".join(keep))
            why = f"a torn or unreadable line {torn}" if torn is not None else "none torn"
            log.info(
                "%s: kept %d records up to step %d, dropped %d (later steps, %s)",
                self.path.name,
                len(keep),
                step,
                dropped,
                why,
            )
        return dropped
