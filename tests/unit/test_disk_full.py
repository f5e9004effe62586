"""Full disks outside the run directory (issue 32, item 5): the caches and checkpoint retention.

``python -m dflash.data.prepare`` runs as a real process under a file size limit (``RLIMIT_FSIZE``:
every write past it fails with EFBIG, as a full disk fails with ENOSPC; no root needed), once for
each cache it writes: the tiny target, the embedded corpus, the tokenized dataset. Each stops with
one ``dflash: error:`` line naming the path, the free space there and the config field that moves
it, exit 2, and leaves no partial entry (only the empty lock file).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO

from dflash.config import EXIT_USER_ERROR, TinyTargetConfig
from dflash.files import DiskFull, disk_full_error


def _limited(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _prepare(tmp_path: Path, cache: Path, limit: int, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "DFLASH_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "dflash.data.prepare", f"hydra.run.dir={tmp_path / 'out'}", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: _limited(limit),
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess, path_prefix: Path, field: str) -> str:
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("dflash: error:")]
    assert f"writing {path_prefix}" in line and "file too large" in line and " free there)" in line
    assert f"{field}=<dir>" in line and "DFLASH_CACHE_DIR=<dir>" in line
    return line


def _entries(root: Path) -> list[str]:
    """Everything under ``root`` but the (empty) lock files and the folders that hold only locks."""

    def only_locks(p: Path) -> bool:
        return p.is_dir() and all(q.is_dir() or q.name.endswith(".lock") for q in p.rglob("*"))

    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not p.name.endswith(".lock") and not only_locks(p)
    )


def test_tiny_target_on_a_full_disk(tmp_path):
    cache = tmp_path / "cache"
    proc = _prepare(tmp_path, cache, 1 << 20)  # the tiny target's weights take 6.9 MB
    where = cache / TinyTargetConfig().cache_subdir()
    _one_error_line(proc, where, "paths.cache_dir")  # was: a SafetensorError traceback
    assert _entries(cache) == []


def test_embedded_corpus_on_a_full_disk(tmp_path, session_cache, tiny_target_dir):
    data_cache = tmp_path / "data_cache"
    proc = _prepare(
        tmp_path,
        session_cache,  # the cache that holds the tiny target
        16 << 10,  # the corpus of 32 prompts takes ~27 KB
        f"data.cache_dir={data_cache}",
        "data.embedded_num_prompts=32",
        "data.embedded_max_new_tokens=8",
        "data.num_eval_prompts=2",
    )
    _one_error_line(proc, data_cache / "embedded" / "corpus-", "data.cache_dir")  # was: OSError: [Errno 28]
    assert _entries(data_cache) == []  # its folder holds only the lock


def test_dataset_cache_on_a_full_disk(tmp_path, session_cache, tiny_target_dir):
    src = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x = 1\n" * 40}]}
        for i in range(120)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_cache = tmp_path / "data_cache"
    proc = _prepare(tmp_path, session_cache, 64 << 10, f"data.path={src}", f"data.cache_dir={data_cache}")
    _one_error_line(proc, data_cache, "data.cache_dir")  # was: SafetensorError ... No space left
    assert _entries(data_cache) == []


@pytest.mark.parametrize(
    "err",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        Exception(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
)
def test_every_wording_of_a_full_disk_is_named(tmp_path, err):
    full = disk_full_error(err, tmp_path / "x", "the fix")
    assert isinstance(full, DiskFull) and full.errno in (errno.ENOSPC, errno.EDQUOT)
    assert str(full).startswith(f"writing {tmp_path / 'x'} failed: ") and str(full).endswith("; the fix")
    assert "\n" not in str(full)
    assert disk_full_error(OSError(errno.EACCES, "Permission denied"), tmp_path, "fix") is None
