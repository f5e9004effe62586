"""The check's subprocesses: each runs in the checkout with a time budget, its output to files, and on
timeout (or Ctrl-C) its whole process tree is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.gpu_check.profiles import OOM_MARKERS, REPO


@dataclass
class Proc:
    """The outcome of one subprocess of the check."""

    rc: int | None
    """Exit code; None when the budget ran out and the process tree was killed."""
    seconds: float
    stdout: str
    stderr: str
    signalled_s: float | None = None
    """Seconds from the start to the signal of ``run_proc(signal_when=...)``; None when none was sent."""

    @property
    def timed_out(self) -> bool:
        """Whether the budget ran out (and the process tree was killed)."""
        return self.rc is None

    def tail(self, n: int = 12) -> list[str]:
        """The last ``n`` non-blank lines of stderr then stdout."""
        lines = [ln for ln in (self.stderr + "\n" + self.stdout).splitlines() if ln.strip()]
        return lines[-n:]

    def out_of_memory(self) -> bool:
        """Whether the output says that a process ran out of memory."""
        text = self.stdout + self.stderr
        return any(m in text for m in OOM_MARKERS)


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process (Linux /proc)."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (torchrun starts each worker in a session of its
    own, so killing the process group is not enough)."""
    children = _children()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_proc(
    cmd: list[str],
    timeout: float,
    log_dir: Path,
    name: str,
    env: dict[str, str],
    signal_when: Callable[[], bool] | None = None,
    signum: signal.Signals = signal.SIGTERM,
) -> Proc:
    """Run ``cmd`` in the repository with output to files (``log_dir/name.{out,err}``); on timeout
    (or Ctrl-C) the whole process tree is killed. With ``signal_when``, ``signum`` goes once to the
    process group of ``cmd`` (as a scheduler preempting a job sends it: torchrun gets it and forwards
    it to its workers) as soon as ``signal_when()`` is true (polled every 0.2 s)."""
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    t0 = time.perf_counter()
    signalled: float | None = None
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        rc: int | None
        deadline = t0 + max(timeout, 1.0)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.0, min(0.2, deadline - time.perf_counter())))
                    break
                except subprocess.TimeoutExpired:
                    if time.perf_counter() >= deadline:
                        raise
                if signal_when is not None and signalled is None and signal_when():
                    signalled = time.perf_counter() - t0
                    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                        os.killpg(proc.pid, signum)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            rc = None
        except BaseException:
            kill_tree(proc.pid)
            proc.wait()
            raise
    return Proc(
        rc,
        time.perf_counter() - t0,
        out_path.read_text(errors="replace"),
        err_path.read_text(errors="replace"),
        signalled,
    )


def child_env(dry_run: bool) -> dict[str, str]:
    """This process's environment for a part: the checkout importable, offline, W&B off, unbuffered;
    a dry run also hides CUDA and runs one OpenMP thread unless told otherwise."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        HYDRA_FULL_ERROR="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("WANDB_API_KEY", None)
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU host
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny sizes: threads only spin against each other
    return env
