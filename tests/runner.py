"""Launch real ``torchrun -m dflash.train`` jobs from tests (gloo, CPU) and read what they leave."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from testpaths import REPO

if TYPE_CHECKING:
    from dflash.train.setup import RunSetup

# A small, fast variant of the embedded default: every test run shares one cache (tiny target,
# regenerated corpus, tokenized data), built once per session by the `run_cache` fixture.
FAST = [
    "data.embedded_num_prompts=64",
    "data.embedded_max_new_tokens=40",
    "data.num_eval_prompts=4",
    "data.max_length=160",
    "data.token_budget=640",
    "data.num_epochs=2",
    "drafter.num_anchors=8",
    "drafter.max_anchors_per_packet=64",
    "logging.progress_bar=false",
    "eval.every=0",
    "topology.init_timeout_s=120",
    "topology.step_timeout_s=60",
]


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path | None
    signalled_after: float | None = None
    """Seconds from the start of torchrun to the signal of ``signal_after``/``signal_at_step``."""
    started_at: float = 0.0
    """``time.time()`` when torchrun was started (to compare with the times in exit records)."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def rank_log(self, rank: int) -> str:
        p = self.run_dir / f"rank{rank}.log"
        return p.read_text() if p.exists() else ""

    def ledger(self) -> list[dict]:
        p = self.run_dir / "ledger.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def exits(self) -> dict[tuple[int, int], dict]:
        """``(rank, attempt) -> exit record`` written by tests/rank_exit.py (``record_exits=True``)."""
        d = exits_dir(self.run_dir)
        recs = (
            [json.loads(p.read_text()) for p in sorted(d.glob("rank*.attempt*.json"))] if d.is_dir() else []
        )
        return {(r["rank"], r["attempt"]): r for r in recs}


def prepare_fast(cache_dir: Path, overrides: list[str] | None = None) -> RunSetup:
    """What every rank of a FAST launch with ``overrides`` derives before its process group
    (``dflash.train.setup.prepare`` at world size 3), computed in this process with
    ``DFLASH_CACHE_DIR=cache_dir``: it builds the caches the ranks then only load."""
    import pytest

    from dflash.config import register_configs, to_config
    from dflash.config.cli import compose_config
    from dflash.train.setup import prepare

    register_configs()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(cache_dir))
        return prepare(to_config(compose_config("config", [*FAST, *(overrides or [])])), 3)


def exits_dir(run_dir: Path) -> Path:
    return run_dir / "rank_exits"


def ledger_steps(run_dir: Path) -> int:
    """The last step written to the run's ledger (0 when there is none yet)."""
    p = run_dir / "ledger.jsonl"
    lines = p.read_text().splitlines() if p.exists() else []
    complete = [ln for ln in lines if ln.endswith("}")]
    return json.loads(complete[-1])["step"] if complete else 0


def env_for(cache_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        DFLASH_CACHE_DIR=str(cache_dir),
        HYDRA_FULL_ERROR="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    env.pop("WANDB_API_KEY", None)
    env.update(extra or {})
    return env


def torchrun_cmd(
    run_dir: Path | None,
    overrides: list[str],
    nproc: int = 3,
    max_restarts: int = 0,
    record_exits: bool = False,
    rdzv: list[str] | None = None,
) -> list[str]:
    """``torchrun ... -m dflash.train`` (``rdzv``: the rendezvous arguments, default ``--standalone``;
    ``run_dir`` None: no ``hydra.run.dir``, the run picks its own under ``outputs/``)."""
    entry = [str(REPO / "tests" / "rank_exit.py")] if record_exits else ["-m", "dflash.train"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rdzv if rdzv is not None else ["--standalone"]),
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        *entry,
        *([f"hydra.run.dir={run_dir}"] if run_dir is not None else []),
        *FAST,
        *overrides,
    ]


def launch(
    run_dir: Path | None,
    overrides: list[str],
    cache_dir: Path,
    *,
    rdzv: list[str] | None = None,
    cwd: Path = REPO,
    nproc: int = 3,
    max_restarts: int = 0,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    signal_after: tuple[float, int] | None = None,
    signal_at_step: tuple[int, int] | None = None,
    signal_at_log: tuple[int, str, int] | None = None,
    record_exits: bool = False,
    forward_signals: bool = True,
) -> Launch:
    """Run one torchrun job to completion (on timeout, torchrun and every process below it are killed).

    ``signal_after=(seconds, signum)`` sends a signal to the job's process group (torchrun: it starts
    every worker in a session of its own and forwards SIGTERM/SIGINT to them) after a delay;
    ``signal_at_step=(step, signum)`` does so once the run's ledger reaches ``step``, and
    ``signal_at_log=(rank, text, signum)`` once ``text`` appears in that rank's log.
    ``record_exits`` starts the ranks through tests/rank_exit.py (see ``Launch.exits``), which forwards
    signals to them unless ``forward_signals`` is False. ``rdzv`` replaces ``--standalone``; with
    ``run_dir`` None the run picks its own directory under ``cwd/outputs/``.
    """
    extra_env = dict(env or {})
    if record_exits:
        shutil.rmtree(exits_dir(run_dir), ignore_errors=True)
        extra_env.update(
            DFLASH_RANK_EXIT_DIR=str(exits_dir(run_dir)), DFLASH_RANK_EXIT_FORWARD=str(int(forward_signals))
        )
    started_at = time.time()
    t0 = time.perf_counter()
    signalled_after = None
    # Files, not pipes: nothing reads the output until the job ends, and a full pipe would block it.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            torchrun_cmd(run_dir, overrides, nproc, max_restarts, record_exits, rdzv),
            cwd=cwd,
            env=env_for(cache_dir, extra_env),
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            if signal_after is not None:
                delay, signum = signal_after
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signum)
                    signalled_after = time.perf_counter() - t0
            trigger = None
            if signal_at_step is not None:
                step, signum = signal_at_step
                trigger = lambda: ledger_steps(run_dir) >= step  # noqa: E731
            if signal_at_log is not None:
                rank, text, signum = signal_at_log
                rank_log = run_dir / f"rank{rank}.log"
                trigger = lambda: rank_log.exists() and text in rank_log.read_text()  # noqa: E731
            if trigger is not None:
                while proc.poll() is None and time.perf_counter() - t0 < timeout:
                    if trigger():
                        os.killpg(proc.pid, signum)
                        signalled_after = time.perf_counter() - t0
                        break
                    time.sleep(0.02)
            proc.wait(timeout=max(timeout - (time.perf_counter() - t0), 1.0))
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            raise AssertionError(
                f"torchrun did not finish within {timeout}s\n{_read(out)[-3000:]}\n{_read(err)[-3000:]}"
            ) from None
        finally:
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
        return Launch(
            proc.returncode,
            _read(out),
            _read(err),
            time.perf_counter() - t0,
            run_dir,
            signalled_after,
            started_at,
        )


def _read(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it. Killing torchrun's process group is not enough:
    torchrun starts each worker in a session of its own."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True
    ).stdout.splitlines():
        pid, ppid = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def no_leftover_processes(run_dir: Path) -> bool:
    """True when no process still runs with this run dir on its command line."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(run_dir) not in out
