"""dflash.files under SIGKILL: after a kill at any point, a path holds its old version or its new one.

Two ways of killing the writer:
- at every step boundary: a forked child SIGKILLs itself right before its n-th filesystem call
  (write, fsync, rename, exchange, rmtree, ...), for every n until the write completes;
- at random moments: a process rewrites a file and a directory in a loop and is SIGKILLed
  after random delays.
After each kill the file (and the directory) must read back as one complete version, and the next
write must succeed.
"""

from __future__ import annotations

import os
import random
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from ranks import context

import dflash.files as files

pytestmark = pytest.mark.faults

SIZE = 1 << 20
_PATCHED = ("open", "replace", "rename", "fsync", "mkdir", "chmod", "write", "unlink", "rmtree", "_exchange")


def _payload(version: int) -> bytes:
    return bytes([version % 251]) * SIZE


def _version_of_file(path: Path) -> int:
    data = path.read_bytes()
    assert len(data) == SIZE and data == data[:1] * SIZE, f"{path}: torn content ({len(data)} bytes)"
    return data[0]


def _version_of_dir(path: Path) -> int:
    names = sorted(p.name for p in path.iterdir())
    assert names == ["a.bin", "b.bin"], f"{path}: {names}"
    a, b = _version_of_file(path / "a.bin"), _version_of_file(path / "b.bin")
    assert a == b, f"{path}: files of two versions ({a}, {b})"
    return a


def _write_dir(path: Path, version: int) -> None:
    with files.atomic_directory(path) as tmp:
        (tmp / "a.bin").write_bytes(_payload(version))
        (tmp / "b.bin").write_bytes(_payload(version))


def _die_at_call(n: int) -> None:
    """In a forked child: SIGKILL this process right before its n-th patched filesystem call."""
    count = [0]

    def wrap(fn):
        def inner(*args, **kwargs):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return inner

    import builtins
    import shutil

    builtins.open = wrap(builtins.open)
    for mod, names in (
        (os, ("replace", "rename", "fsync", "mkdir", "chmod", "write", "unlink")),  # rmtree unlinks too
        (shutil, ("rmtree",)),
    ):
        for name in names:
            setattr(mod, name, wrap(getattr(mod, name)))
    files._exchange = wrap(files._exchange)


def _killed_at_every_step(write, check, path: Path) -> int:
    """Run ``write`` in forked children killed before their 1st, 2nd, ... filesystem call until one
    completes; after each kill ``check`` must accept the path. Returns the number of kill points."""
    n = 1
    while True:
        pid = os.fork()
        if pid == 0:  # child
            try:
                _die_at_call(n)
                write()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        check()
        if os.WIFEXITED(status):
            return n - 1
        assert os.WTERMSIG(status) == signal.SIGKILL
        n += 1
        assert n < 200, "the write never completed"


def test_file_is_old_or_new_after_a_kill_at_every_step(tmp_path):
    path = tmp_path / "state.bin"
    files.atomic_write(path, _payload(1))
    seen: set[int] = set()

    def check():
        seen.add(_version_of_file(path))

    kills = _killed_at_every_step(lambda: files.atomic_write(path, _payload(2)), check, path)
    assert kills >= 4 and seen == {1, 2}, (kills, seen)
    assert _version_of_file(path) == 2


def test_directory_is_old_or_new_after_a_kill_at_every_step(tmp_path):
    path = tmp_path / "drafter"
    _write_dir(path, 1)
    seen: set[int] = set()

    def check():
        seen.add(_version_of_dir(path))

    kills = _killed_at_every_step(lambda: _write_dir(path, 2), check, path)
    assert kills >= 6 and seen == {1, 2}, (kills, seen)
    _write_dir(path, 3)  # leftovers of the killed writes do not get in the way
    assert _version_of_dir(path) == 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".drafter.") and ".old-" in p.name]


def test_directory_without_exchange_is_restored_after_a_kill(tmp_path, monkeypatch):
    """Where renameat2 is missing the old directory is moved aside first; a kill between the two
    renames leaves no ``path`` for a moment, and the next write puts the old copy back first."""
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    path = tmp_path / "drafter"
    _write_dir(path, 1)
    found: list[int | None] = []

    def check():
        if path.exists():
            found.append(_version_of_dir(path))
        else:  # killed between the renames: the old copy is aside, restored by the next write's start
            files._restore_interrupted(path)
            found.append(None)
            assert _version_of_dir(path) == 1

    _killed_at_every_step(lambda: _write_dir(path, 2), check, path)
    assert None in found and _version_of_dir(path) == 2


def _rewrite_forever(root: str, version: int, ready: Connection) -> None:
    """A writer process: says it is ready, then rewrites a file and a directory until it is killed."""
    path = Path(root)
    ready.send(version)
    while True:
        version += 1
        files.atomic_write(path / "state.bin", _payload(version))
        _write_dir(path / "drafter", version)


def test_random_sigkills_leave_a_complete_version(tmp_path):
    """A writer rewriting a file and a directory in a loop, SIGKILLed 25 times at random moments (a
    process forked from tests/ranks.py's forkserver, which has already imported what it needs)."""
    rng = random.Random(0)
    files.atomic_write(tmp_path / "state.bin", _payload(0))
    _write_dir(tmp_path / "drafter", 0)
    ctx = context()
    versions = []
    for i in range(25):
        start = _version_of_file(tmp_path / "state.bin")
        ready, ready_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rewrite_forever, args=(str(tmp_path), start + 10 * i, ready_w))
        proc.start()
        ready_w.close()
        assert ready.poll(60) and ready.recv() == start + 10 * i  # in the loop now
        time.sleep(rng.random() * 0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        files._restore_interrupted(tmp_path / "drafter")  # what the next atomic_directory does first
        versions.append((_version_of_file(tmp_path / "state.bin"), _version_of_dir(tmp_path / "drafter")))
    assert len({v for v, _ in versions}) > 1  # the writer did make progress between the kills


def test_a_checkpoint_killed_while_retention_removes_it_is_never_marked_and_incomplete(tmp_path):
    """Retention removes step 1 of 3 (keep 2), killed before each of its filesystem calls (each file
    rmtree deletes included): every ``step_*`` directory left with a COMPLETE marker verifies, and
    the next save's retention removes what the kill left (was: step 1 marked, without optimizer.pt)."""
    import torch

    from dflash.train import checkpoint as ckpt

    root = tmp_path / "checkpoints"

    def save(step: int) -> None:
        ckpt.save_checkpoint(
            root,
            step,
            model_state={"w": torch.full((256,), float(step))},
            optimizer_state={"state": {}, "param_groups": []},
            scheduler_state={},
            train_state=ckpt.TrainState(step=step),
            rng_state={},
            contract={},
            config_yaml="",
            keep=3,
        )

    for step in (1, 2, 3):
        save(step)

    def check() -> None:
        for path in root.glob("step_*"):
            if (path / ckpt.MARKER).exists():
                ckpt.verify_checkpoint(path)

    kills = _killed_at_every_step(lambda: ckpt._apply_retention(root, 3, 2), check, root)
    assert kills >= 5, kills
    ckpt._apply_retention(root, 3, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
