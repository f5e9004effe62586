"""The regeneration output: append-only, resumable, with its failures and its ``meta.json``.

- ``<output>``: one JSON line per regenerated record, ``{"id", "source_index", "messages",
  "finish_reasons"}``, appended with :func:`dflash.files.append_line` (one write, fsynced) as each
  record completes. On open, a line torn by a crash is cut off (that record is redone) and the
  ``source_index`` of every complete line is read: those records are skipped, so re-running the
  same command never duplicates a record.
- ``<output>.failed.jsonl``: this run's failed records with the reason; reset at the start of a
  run, since every record not in the output is tried again.
- ``<output>.meta.json``: the model, the endpoints, the sampling settings, the
  ``chat_template_kwargs`` (checked by training against ``data.chat_template_kwargs``) and the
  counts; written atomically. A run whose settings differ from those of the records already in the
  file is refused.
- ``.<output>.lock``: held for the whole run, so two runs never write one output.

Every line and ``meta.json`` is written with the environment's secrets redacted
(:func:`redacted_json`): a server may echo the API key in an error body or in a reply.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from dflash.config.secrets import redact, secret_values
from dflash.data.sources import sidecar_meta_path
from dflash.files import append_line, atomic_write, drop_torn_tail, file_lock

META_VERSION = 1


def redacted_json(value: Any, **dumps_kwargs: Any) -> str:
    """``json.dumps(value, **dumps_kwargs)`` with every secret value of the environment replaced
    by ``<redacted>``, also where JSON escaping changed how a secret is spelled."""
    text = json.dumps(value, **dumps_kwargs)
    forms = {
        form
        for secret in secret_values()
        for form in (secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1])
    }
    return redact(text, sorted(forms, key=len, reverse=True)) if forms else text


def failed_path(output: Path) -> Path:
    return output.with_name(output.name + ".failed.jsonl")


class RegenOutput:
    """An opened output (see the module docstring); use :func:`open_output`."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path, self.settings = path, settings
        self.meta_path, self.failed_path = sidecar_meta_path(path), failed_path(path)
        self.torn_bytes = drop_torn_tail(path)
        self.done = self._read_done()
        self.written = 0
        self.failed: dict[str, int] = {}

    def _read_done(self) -> set[int]:
        """``source_index`` of every record already in the output."""
        done: set[int] = set()
        if not self.path.exists():
            return done
        if self.meta_path.exists():
            old = json.loads(self.meta_path.read_text()).get("settings", {})
            changed = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
            if changed:
                diff = "; ".join(
                    f"{k}: {old.get(k)!r} in the file, {self.settings.get(k)!r} now" for k in changed
                )
                raise ValueError(
                    f"output={str(self.path)!r} holds records generated with other settings ({diff}); "
                    "re-run with the same settings to resume it, or set output=<a new file>"
                )
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    idx = json.loads(raw)["source_index"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"output={str(self.path)!r} line {lineno} is not a regenerated record ({exc}); "
                        "the file was changed by something else: set output=<a new file>"
                    ) from None
                if idx in done:
                    raise ValueError(f"output={str(self.path)!r} line {lineno}: record {idx} appears twice")
                done.add(idx)
        return done

    def write(self, record: dict[str, Any]) -> None:
        """Append one regenerated record (a complete, fsynced line). Raises UnicodeEncodeError,
        writing nothing, when the record holds a lone surrogate (no UTF-8 file can hold it)."""
        line = redacted_json(record, ensure_ascii=False)
        line.encode("utf-8")
        append_line(self.path, line)
        self.done.add(record["source_index"])
        self.written += 1

    def fail(self, source_index: int, source_id: Any, where: str, reason: str, error: str) -> None:
        """Record a failed record of this run in ``<output>.failed.jsonl``."""
        line = {
            "source_index": source_index,
            "id": source_id,
            "where": where,
            "reason": reason,
            "error": error,
        }
        append_line(self.failed_path, redacted_json(line))  # ASCII: any id or message can be written
        self.failed[reason] = self.failed.get(reason, 0) + 1

    def write_meta(self, extra: dict[str, Any]) -> None:
        """``meta.json``: the settings (top-level ``chat_template_kwargs`` too), the counts, ``extra``."""
        meta = {
            "version": META_VERSION,
            "settings": self.settings,
            "chat_template_kwargs": self.settings.get("chat_template_kwargs", {}),
            "records_in_output": len(self.done),
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **extra,
        }
        atomic_write(self.meta_path, redacted_json(meta, indent=1, sort_keys=True))


@contextmanager
def open_output(path: str | Path, settings: dict[str, Any]) -> Iterator[RegenOutput]:
    """Lock and open ``path`` for a run with ``settings`` (what the records' content depends on);
    raises ValueError when another run holds it or it was made with other settings."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(out.with_name(f".{out.name}.lock"), blocking=False))
        except BlockingIOError:
            raise ValueError(
                f"output={str(out)!r} is being written by another regenerate run; wait for it or set "
                "output=<another file>"
            ) from None
        opened = RegenOutput(out, settings)
        atomic_write(opened.failed_path, "")
        yield opened
