"""Launch real ``dflash.train`` jobs from tests (gloo, CPU) and read what they leave.

``launch`` runs a job's ranks as forks of the session's preloaded forkserver (tests/ranks.py): each
rank gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_ERROR_FILE), the command line torchrun would pass
(``sys.argv``) and calls the entry point ``python -m dflash.train`` runs; a rank that fails gets the
others SIGTERM, as under torchrun. ``launch(..., torchrun=True)`` starts real ``torchrun`` instead,
for what only torchrun does: restarts (``max_restarts``), forwarding its own signals to the workers,
rendezvous (``rdzv``: c10d, several agents), and its handling of the workers' output; its workers
(tests/rank_exit.py) have their rank forked by the session's rank server (tests/ranks.py) with the
environment torchrun gave them, or start ``python -m dflash.train`` (``fresh_interpreters``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ranks import RANK_SERVER_ENV, RankExit, World, as_main, free_port, rank_server, rank_specs, torchrun_env
from testpaths import REPO

from dflash.cli import hydra_quote
from dflash.train.faults import FAULTS_ENV
from dflash.train.job import main as job_main  # the entry point `python -m dflash.train` runs

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
    """torchrun's exit code; in-process: 0, or the exit code of the first rank that failed."""
    stdout: str
    stderr: str
    """All ranks' output (in-process: rank 0's, then rank 1's, ...)."""
    seconds: float
    run_dir: Path | None
    signalled_after: float | None = None
    """Seconds from the start of the launch to the signal of ``signal_at_step``/``signal_at_log``."""
    started_at: float = 0.0
    """``time.time()`` when the launch started (to compare with the times in exit records)."""
    ranks: dict[int, RankExit] | None = None
    """In-process launches: how each rank ended (torchrun launches: ``record_exits`` and ``exits()``)."""
    stdio_dir: Path | None = None
    """In-process launches: ``rank{r}.out``, ``rank{r}.err``, ``rank{r}.error.json`` of every rank."""
    rank_pids: list[int] = field(default_factory=list)
    """In-process launches: each rank's pid (= its session id)."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def returncodes(self) -> dict[int, int | None]:
        """In-process launches: rank -> exit code (< 0: killed by that signal)."""
        assert self.ranks is not None, "a torchrun launch: use record_exits=True and exits()"
        return {r: e.returncode for r, e in self.ranks.items()}

    def rank_output(self, rank: int) -> str:
        """In-process launches: what rank ``rank`` printed (stdout, then stderr)."""
        assert self.stdio_dir is not None
        return "".join(
            p.read_text(errors="replace")
            for p in (self.stdio_dir / f"rank{rank}.out", self.stdio_dir / f"rank{rank}.err")
        )

    def error_file(self, rank: int) -> dict | None:
        """In-process launches: the error record ``dflash.cli``'s ``@record`` left for torchrun
        (``TORCHELASTIC_ERROR_FILE``) on rank ``rank``, if it failed with an exception."""
        assert self.stdio_dir is not None
        p = self.stdio_dir / f"rank{rank}.error.json"
        return json.loads(p.read_text()) if p.exists() else None

    @property
    def dir(self) -> Path:
        assert self.run_dir is not None, "a launch without hydra.run.dir"
        return self.run_dir

    def rank_log(self, rank: int) -> str:
        p = self.dir / f"rank{rank}.log"
        return p.read_text() if p.exists() else ""

    def ledger(self) -> list[dict]:
        p = self.dir / "ledger.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def exits(self) -> dict[tuple[int, int], dict]:
        """``(rank, attempt) -> {"rank", "attempt", "returncode", "start", "end", "signals"}``: of an
        in-process launch (one attempt), or written by tests/rank_exit.py (``record_exits=True``)."""
        if self.ranks is not None:
            return {(r, 0): {**asdict(e), "attempt": 0} for r, e in self.ranks.items()}
        d = exits_dir(self.dir)
        recs = (
            [json.loads(p.read_text()) for p in sorted(d.glob("rank*.attempt*.json"))] if d.is_dir() else []
        )
        return {(r["rank"], r["attempt"]): r for r in recs}


def prepare_fast(cache_dir: Path, overrides: list[str] | None = None) -> RunSetup:
    """What every rank of a FAST launch with ``overrides`` derives before its process group
    (``dflash.train.setup.prepare`` at world size 3), computed in this process with
    ``DFLASH_CACHE_DIR=cache_dir``: it builds the caches the ranks then only load."""
    import pytest

    from dflash.cli import compose_config
    from dflash.config import register_configs, to_config
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
    rdzv: list[str] | None = None,
) -> list[str]:
    """``torchrun ... tests/rank_exit.py <args of dflash.train>`` (``rdzv``: the rendezvous arguments,
    default ``--standalone``; ``run_dir`` None: no ``hydra.run.dir``, the run picks its own under
    ``outputs/``)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rdzv if rdzv is not None else ["--standalone"]),
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        str(REPO / "tests" / "rank_exit.py"),
        *([f"hydra.run.dir={hydra_quote(str(run_dir))}"] if run_dir is not None else []),
        *FAST,
        *overrides,
    ]


def job_rank(rank: int, argv: list[str]) -> int:
    """One rank of an in-process launch (tests/ranks.py runs it in a forked rank process): what
    ``python -m dflash.train <argv>`` does; returns the exit code."""
    sys.argv = [str(sys.modules[job_main.__module__].__file__), *argv]
    return as_main(job_main)


Trigger = tuple[Callable[[], bool], int]
"""When to send a signal, and which one."""


def _trigger(
    run_dir: Path | None, signal_at_step: tuple[int, int] | None, signal_at_log: tuple[int, str, int] | None
) -> Trigger | None:
    if signal_at_step is not None:
        assert run_dir is not None
        step, signum = signal_at_step
        return (lambda: ledger_steps(run_dir) >= step), signum
    if signal_at_log is not None:
        assert run_dir is not None
        rank, text, signum = signal_at_log
        rank_log = run_dir / f"rank{rank}.log"
        return (lambda: rank_log.exists() and text in rank_log.read_text()), signum
    return None


def faults_to_env(overrides: list[str], env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """``fault.<field>=<value>`` overrides taken out of the command line and put in the ranks'
    environment as ``DFLASH_FAULTS`` (JSON): fault injection is not part of the run's config
    (``dflash.train.faults``). Values are read as YAML, as Hydra reads them."""
    import yaml

    faults = {
        a.split("=", 1)[0][len("fault.") :]: yaml.safe_load(a.split("=", 1)[1])
        for a in overrides
        if a.startswith("fault.")
    }
    rest = [a for a in overrides if not a.startswith("fault.")]
    out = dict(env or {})
    if faults:
        out[FAULTS_ENV] = json.dumps(faults)
    return rest, out


def launch(
    run_dir: Path | None,
    overrides: list[str],
    cache_dir: Path,
    *,
    nproc: int = 3,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    signal_at_step: tuple[int, int] | None = None,
    signal_at_log: tuple[int, str, int] | None = None,
    signal_ranks: Sequence[int] | None = None,
    stop_peers_on_failure: bool = True,
    grace_s: float = 30.0,
    torchrun: bool = False,
    rdzv: list[str] | None = None,
    cwd: Path = REPO,
    max_restarts: int = 0,
    record_exits: bool = False,
    forward_signals: bool = True,
    fresh_interpreters: bool = False,
) -> Launch:
    """Run one job of ``nproc`` ranks to completion: ``FAST`` + ``overrides`` in ``run_dir``.

    ``signal_at_step=(step, signum)`` sends a signal once the run's ledger reaches ``step``,
    ``signal_at_log=(rank, text, signum)`` once ``text`` appears in that rank's log: to every rank
    (in-process: to ``signal_ranks`` when given; torchrun: to torchrun's process group, and torchrun
    forwards SIGTERM/SIGINT to its workers). After ``timeout`` seconds every process of the job is
    killed and the test fails.

    In-process (the default): the ranks are forks of tests/ranks.py's forkserver; when a rank exits
    non-zero the others get SIGTERM and, ``grace_s`` later, SIGKILL (torchrun's answer), unless
    ``stop_peers_on_failure`` is False: then every rank is left to end on its own.

    ``torchrun=True``: a real ``torchrun`` (``rdzv`` replaces ``--standalone``; with ``run_dir`` None
    the run picks its own directory under ``cwd/outputs/``). Its workers are tests/rank_exit.py,
    which forwards signals to the rank unless ``forward_signals`` is False and, with
    ``record_exits``, records how each attempt of each rank ended (``Launch.exits``). The rank is a
    fork of the session's rank server (tests/ranks.py) with the worker's environment, or with
    ``fresh_interpreters`` a new ``python -m dflash.train`` as torchrun would start it.
    """
    trigger = _trigger(run_dir, signal_at_step, signal_at_log)
    overrides, env = faults_to_env(overrides, env)
    if torchrun:
        assert signal_ranks is None and stop_peers_on_failure and grace_s == 30.0, "torchrun decides these"
        extra_env = {**(env or {}), "DFLASH_RANK_EXIT_FORWARD": str(int(forward_signals))}
        if record_exits:
            assert run_dir is not None
            shutil.rmtree(exits_dir(run_dir), ignore_errors=True)
            extra_env["DFLASH_RANK_EXIT_DIR"] = str(exits_dir(run_dir))
        if not fresh_interpreters:
            extra_env[RANK_SERVER_ENV] = rank_server()
        cmd = torchrun_cmd(run_dir, overrides, nproc, max_restarts, rdzv)
        return _launch_torchrun(cmd, run_dir, env_for(cache_dir, extra_env), cwd, timeout, trigger)
    assert run_dir is not None, "an in-process launch needs its run dir"
    assert (
        rdzv is None and max_restarts == 0 and not record_exits and forward_signals and not fresh_interpreters
    ), "torchrun=True does these"
    return _launch_in_process(
        run_dir,
        overrides,
        cache_dir,
        cwd,
        nproc,
        timeout,
        env,
        trigger,
        signal_ranks,
        stop_peers_on_failure,
        grace_s,
    )


def _launch_in_process(
    run_dir: Path,
    overrides: list[str],
    cache_dir: Path,
    cwd: Path,
    nproc: int,
    timeout: float,
    env: dict[str, str] | None,
    trigger: Trigger | None,
    signal_ranks: Sequence[int] | None,
    stop_peers_on_failure: bool,
    grace_s: float,
) -> Launch:
    stdio = run_dir.parent / f"{run_dir.name}.ranks"
    shutil.rmtree(stdio, ignore_errors=True)
    base, port = env_for(cache_dir, env), free_port()

    def rank_env(r: int) -> dict[str, str]:
        error_file = str(stdio / f"rank{r}.error.json")
        return {**base, **torchrun_env(r, nproc, port), "TORCHELASTIC_ERROR_FILE": error_file}

    argv = [f"hydra.run.dir={hydra_quote(str(run_dir))}", *FAST, *overrides]
    world = World(rank_specs(nproc, job_rank, (argv,), rank_env, cwd, stdio))
    signalled_after = None
    started_at, t0 = time.time(), time.perf_counter()

    def on_trigger(w: World) -> None:
        nonlocal signalled_after
        assert trigger is not None
        w.signal(trigger[1], signal_ranks)
        signalled_after = time.perf_counter() - t0

    world.run(
        timeout,
        trigger=trigger[0] if trigger else None,
        on_trigger=on_trigger,
        stop_peers_on_failure=stop_peers_on_failure,
        grace_s=grace_s,
    )
    seconds = time.perf_counter() - t0
    out, err = world.output()
    if world.hung:
        raise AssertionError(
            f"ranks {world.hung} did not finish within {timeout}s (killed)\n{out[-3000:]}\n{err[-3000:]}"
        )
    return Launch(
        returncode=world.returncode(),
        stdout=out,
        stderr=err,
        seconds=seconds,
        run_dir=run_dir,
        signalled_after=signalled_after,
        started_at=started_at,
        ranks=world.exits,
        stdio_dir=stdio,
        rank_pids=world.pids,
    )


def _launch_torchrun(
    cmd: list[str],
    run_dir: Path | None,
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    trigger: Trigger | None,
) -> Launch:
    started_at = time.time()
    t0 = time.perf_counter()
    signalled_after = None
    # Files, not pipes: nothing reads the output until the job ends, and a full pipe would block it.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            if trigger is not None:
                fired, signum = trigger
                while proc.poll() is None and time.perf_counter() - t0 < timeout:
                    if fired():
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


def no_leftover_processes(*runs: Launch | Path) -> bool:
    """True when nothing of these launches still runs: no process in an in-process rank's session,
    no process with a torchrun launch's run dir (or the given run dir) on its command line."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    procs = [line.split(None, 2) for line in out.splitlines() if line.strip()]
    for run in runs:
        if isinstance(run, Path):
            run = Launch(0, "", "", 0.0, run)
        if run.ranks is not None:
            sessions = {str(pid) for pid in run.rank_pids}
            if any(sid in sessions for _, sid, *_ in procs):
                return False
        elif any(str(run.run_dir) in (rest[0] if rest else "") for _, _, *rest in procs):
            return False
    return True
