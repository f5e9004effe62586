"""Read an offline W&B run (wandb 0.31) back into Python, for tests.

wandb 0.31 writes everything about an offline run into one ``run-<id>.wandb`` file and no
``wandb-summary.json``/``config.yaml`` (``wandb.Api()`` cannot read local runs either). The file is
``:W&B`` + magic 0xBEE1 + version byte (7 bytes), then LevelDB-log framing: 32 KiB blocks of records
with a 7-byte header ``<IHB`` (crc32c, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4); a block tail
shorter than a header is zero padding. Each reassembled record is a
``wandb.proto.wandb_internal_pb2.Record`` protobuf.

Usage::

    run = read_wandb_run(run_dir)          # run_dir/wandb/offline-run-*/run-*.wandb, newest
    run.history  # [{"_step": 0, "train/step": 1, "train/loss": 2.3, ...}, ...]
    run.summary  # merged summary, e.g. {"train/loss": {"min": 0.5, "last": 0.7}, ...}
    run.config   # the config dict passed to wandb.init / config.update (without "_wandb")
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """define_metric records: {"name"/"glob_name", "step_metric", "summary": [...]}."""
    stats: list[dict[str, Any]] = field(default_factory=list)
    """System-metric samples (empty when x_disable_stats or the run was short)."""
    run_id: str | None = None
    path: Path | None = None


def find_wandb_files(path: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file under ``path`` (a run dir, its ``wandb/`` dir or an offline-run
    dir), oldest first (by modification time, then name)."""
    p = Path(path)
    if p.is_file():
        return [p]
    candidates: list[Path] = []
    for base in (p, p / "wandb"):
        if base.is_dir():
            candidates += [f for f in base.glob("run-*.wandb") if f.is_file()]
            candidates += [
                f
                for d in base.glob("offline-run-*")
                if d.is_dir() and not d.is_symlink()
                for f in d.glob("run-*.wandb")
                if f.is_file()
            ]
    uniq = {f.resolve(): f for f in candidates}
    return sorted(uniq.values(), key=lambda f: (f.stat().st_mtime_ns, f.parent.name))


def find_wandb_file(path: str | Path) -> Path:
    """The newest ``.wandb`` file under ``path``; raises FileNotFoundError if there is none."""
    p = Path(path)
    latest = p / "wandb" / "latest-run"
    if p.is_dir() and latest.is_dir():
        files = sorted(latest.glob("run-*.wandb"))
        if files:
            return files[-1]
    files = find_wandb_files(p)
    if not files:
        raise FileNotFoundError(f"no offline W&B run file (wandb/offline-run-*/run-*.wandb) under {p}")
    return files[-1]


def iter_records(path: str | Path) -> Iterator[Any]:
    """Yield every ``Record`` protobuf of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, buf = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, rtype = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if rtype == 0 and length == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if len(chunk) < length:  # a record still being written
            break
        pos += _HEADER + length
        if rtype in (_FULL, _FIRST):
            buf = chunk
        elif rtype in (_MIDDLE, _LAST):
            buf += chunk
        else:
            raise ValueError(f"{path}: unknown record type {rtype} at byte {pos}")
        if rtype in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def _items(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        key = it.key or "/".join(it.nested_key)
        out[key] = json.loads(it.value_json)
    return out


def read_wandb_run(path_or_dir: str | Path) -> WandbRun:
    """Parse an offline run: ``path_or_dir`` is a ``.wandb`` file, an offline-run dir, a
    ``wandb/`` dir or the run dir passed as ``dir=`` to ``wandb.init`` (newest run is read)."""
    path = find_wandb_file(path_or_dir)
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    run_id: str | None = None
    for r in iter_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append(_items(r.history.item))
        elif kind == "summary":
            summary.update(_items(r.summary.update))
            for it in r.summary.remove:
                summary.pop(it.key or "/".join(it.nested_key), None)
        elif kind == "run":
            run_id = r.run.run_id or run_id
            config.update(_items(r.run.config.update))
        elif kind == "config":
            config.update(_items(r.config.update))
            for it in r.config.remove:
                config.pop(it.key or "/".join(it.nested_key), None)
        elif kind == "metric":
            m = r.metric
            metrics.append(
                {
                    "name": m.name,
                    "glob_name": m.glob_name,
                    "step_metric": m.step_metric,
                    "summary": [
                        s
                        for s in ("min", "max", "mean", "last", "best", "first")
                        if getattr(m.summary, s, False)
                    ],
                }
            )
        elif kind == "stats":
            stats.append(_items(r.stats.item))
    config.pop("_wandb", None)
    return WandbRun(
        history=history,
        summary=summary,
        config=config,
        metrics=metrics,
        stats=stats,
        run_id=run_id,
        path=path,
    )


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """History rows of every launch that logged into ``run_dir`` (a resumed run writes one offline
    folder per launch), oldest launch first."""
    rows: list[dict[str, Any]] = []
    for f in find_wandb_files(run_dir):
        rows += read_wandb_run(f).history
    return rows
