"""Rank processes for the tests, forked from one preloaded forkserver.

A test that needs several torch.distributed ranks starts them here rather than as fresh interpreters:
the session's forkserver (``multiprocessing``'s 'forkserver' start method) imports ``PRELOAD`` (torch,
Hydra, transformers, the training job) once, and every rank is a fork of it. A rank runs
``fn(rank, *args)`` (a module-level function; its return value is the exit code) in a session of
its own, with exactly the environment it is given, its stdout/stderr in files, and it dies with the
forkserver (which dies with the test process). ``World`` starts the ranks and watches them: signals
to some or all of them (to each rank's session, as torchrun signals its workers) when a trigger
fires, torchrun's answer to a failed rank (SIGTERM the others, SIGKILL them after a grace period)
unless told otherwise, and a deadline after which every rank still alive is killed: no test hangs.
``run_module`` runs an app under test (``python -m <module>``) the same way, as a world of one.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import io
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast

PRELOAD = (
    "pytest",  # multiprocessing re-runs the parent's main script (pytest's entry point) in each rank
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
    "hydra",
    "omegaconf",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.gpt_oss.modeling_gpt_oss",
    "wandb",
    "dflash.train.job",
    "dflash.train.setup",
    "dflash.train.target_worker",
    "dflash.train.trainer",
    "dflash.train.periodic_eval",
    "dflash.targets.loader",
    "dflash.targets.forward",
    "dflash.distributed.links",
    "dflash.distributed.process_group",
)
"""What the forkserver imports before it forks any rank: everything a training rank (and the ranks
of ``run_ranks``' tests: transport, sharding, TP targets) imports, so that no rank pays for it. A name here that no longer exists fails the
first start (``context``), instead of silently making every rank import it again."""

TORCHRUN_MONITOR_S = 0.5
"""How soon after a rank fails the others get SIGTERM (torchrun's ``--monitor-interval`` of tests/runner.py)."""

_SERVER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
"""Set while the forkserver starts: what libraries read at import time must say what every rank's
environment says (each rank then replaces the whole environment with its own)."""

_ready = False
_ready_lock = threading.Lock()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def context() -> ForkServerContext:
    """The 'forkserver' context, its server started (importing ``PRELOAD``) on the first call."""
    global _ready
    ctx = cast(ForkServerContext, mp.get_context("forkserver"))
    with _ready_lock:
        if _ready:
            return ctx
        missing = [m for m in PRELOAD if importlib.util.find_spec(m) is None]
        assert not missing, f"tests/ranks.py PRELOAD names modules that do not exist: {missing}"
        ctx.set_forkserver_preload(list(PRELOAD))
        saved = {k: os.environ.get(k) for k in _SERVER_ENV}
        os.environ.update(_SERVER_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _ready = True
    return ctx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankSpec:
    """What one rank process runs, and where."""

    fn: Callable[..., int | None]
    args: tuple[Any, ...]
    env: dict[str, str]
    cwd: str
    stdout: str
    stderr: str


def _rank_main(rank: int, spec: RankSpec) -> None:
    """The rank process: its own session, files for stdout/stderr, then ``_enter`` and ``spec.fn``,
    whose return value is the exit code."""
    die_with_parent()
    os.setsid()
    for stream, fd, path in ((sys.stdout, 1, spec.stdout), (sys.stderr, 2, spec.stderr)):
        stream.flush()
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _enter(spec.env, spec.cwd)
    sys.exit(spec.fn(rank, *spec.args) or 0)


def _enter(env: dict[str, str], cwd: str) -> None:
    """Unbuffered stdout/stderr on fds 1 and 2 (as PYTHONUNBUFFERED=1 makes them), exactly ``env``,
    ``cwd``, and as many torch threads as its OMP_NUM_THREADS says (torch is already imported)."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


@dataclass
class RankExit:
    """How one rank ended: ``returncode`` < 0 means killed by that signal, None still running;
    ``start``, ``end`` and the times in ``signals`` (what this harness sent it) are ``time.time()``."""

    rank: int
    start: float
    returncode: int | None = None
    end: float | None = None
    signals: list[tuple[int, float]] = field(default_factory=list)


class World:
    """``len(specs)`` rank processes; rank r runs ``specs[r]``."""

    def __init__(self, specs: Sequence[RankSpec]) -> None:
        self.specs = list(specs)
        self.procs: list[BaseProcess] = []
        self.pids: list[int] = []
        """Each rank's pid, which is also its session id."""
        self.exits: dict[int, RankExit] = {}
        self.hung: list[int] = []
        """The ranks still running at the deadline (then killed)."""

    def start(self) -> None:
        ctx = context()
        # Not daemonic: a rank may start processes of its own (data workers), as under torchrun.
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, s), name=f"rank{r}") for r, s in enumerate(self.specs)
        ]
        for r, p in enumerate(self.procs):
            self.exits[r] = RankExit(r, time.time())
            p.start()
            self.pids.append(cast(int, p.pid))

    def alive(self) -> list[int]:
        return [r for r, e in self.exits.items() if e.returncode is None]

    def signal(self, signum: int, ranks: Sequence[int] | None = None) -> None:
        """Send ``signum`` to the session of each rank in ``ranks`` (all) still running."""
        for r in self.alive() if ranks is None else ranks:
            if self.exits[r].returncode is None:
                self.exits[r].signals.append((int(signum), time.time()))
                try:
                    os.killpg(self.pids[r], signum)
                except ProcessLookupError:
                    pass

    def _reap(self, wait_s: float) -> None:
        pending = {self.procs[r].sentinel: r for r in self.alive()}
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=wait_s):
            r = pending[sentinel]  # type: ignore[index]
            self.procs[r].join()
            self.exits[r].returncode, self.exits[r].end = self.procs[r].exitcode, time.time()

    def run(
        self,
        timeout: float,
        *,
        trigger: Callable[[], bool] | None = None,
        on_trigger: Callable[[World], None] | None = None,
        stop_peers_on_failure: bool = True,
        grace_s: float = 30.0,
        poll: Callable[[list[BaseProcess]], None] | None = None,
        tick_s: float = 0.02,
    ) -> None:
        """Start the ranks and wait for all of them, looking every ``tick_s``. Once ``trigger()`` is
        true, ``on_trigger(self)`` runs (once); ``poll(procs)`` runs at every look (e.g. to sample the
        ranks' memory from outside). ``stop_peers_on_failure``: as torchrun, a rank's non-zero exit
        gets the others SIGTERM and, ``grace_s`` later, SIGKILL. After ``timeout`` seconds every rank
        still running is killed (``hung``)."""
        self.start()
        t0 = time.monotonic()
        failed_at: float | None = None
        termed_at: float | None = None
        try:
            while self.alive():
                if poll is not None:
                    poll(self.procs)
                self._reap(tick_s)
                now = time.monotonic()
                if trigger is not None and on_trigger is not None and trigger():
                    on_trigger(self)
                    trigger = None
                if (
                    stop_peers_on_failure
                    and failed_at is None
                    and any(e.returncode for e in self.exits.values())
                ):
                    failed_at = now
                if failed_at is not None and termed_at is None and now - failed_at >= TORCHRUN_MONITOR_S:
                    self.signal(signal.SIGTERM)
                    termed_at = now
                if termed_at is not None and now - termed_at >= grace_s:
                    self.kill()
                if now - t0 > timeout:
                    self.hung = self.alive()
                    break
        finally:
            self.kill()

    def returncode(self) -> int:
        """0, or the exit code of the rank that failed first (< 0: killed by that signal)."""
        failed = sorted((e for e in self.exits.values() if e.returncode), key=lambda e: e.end or 0.0)
        return (failed[0].returncode or 0) if failed else 0

    def output(self) -> tuple[str, str]:
        """Every rank's stdout (rank 0's, then rank 1's, ...) and every rank's stderr."""
        out, err = (
            "".join(Path(getattr(spec, name)).read_text(errors="replace") for spec in self.specs)
            for name in ("stdout", "stderr")
        )
        return out, err

    def kill(self) -> None:
        """SIGKILL every rank still running (its whole session) and reap it."""
        for r in self.alive():
            try:
                os.killpg(self.pids[r], signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.alive():
            self._reap(1.0)


def rank_env(rank: int, world: int) -> None:
    """The torchrun environment of ``rank`` (of ``run_ranks``' entries) and one intra-op thread."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)


def finish_rank(rank: int, tmp: str, body: Callable[[], dict | None]) -> None:
    """Run ``body`` in the rank's environment and write ``{"rank", "ok", ...body's result}`` (or the
    error and its traceback) to ``tmp/rank{rank}.json``; then exit the process without cleanup."""
    result: dict[str, Any] = {"rank": rank}
    try:
        result.update(body() or {})
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error_type=type(e).__name__, error=str(e), traceback=traceback.format_exc())
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run_ranks(
    tmp_path: Path,
    entry: Callable[..., None],
    world: int,
    args: Sequence[Any] = (),
    *,
    deadline_s: float = 40.0,
    poll: Callable[[list[BaseProcess]], None] | None = None,
) -> dict[int, dict]:
    """``world`` rank processes running ``entry(rank, world, str(tmp_path), *args)`` (an entry ends
    with ``finish_rank``), joined with a deadline that kills stragglers; each rank's result.
    ``poll(procs)`` is called about every millisecond while they run. Output: ``tmp_path/stdio/``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    specs = rank_specs(
        world, entry, (world, str(tmp_path), *args), lambda r: env, Path.cwd(), tmp_path / "stdio"
    )
    w = World(specs)
    w.run(deadline_s, stop_peers_on_failure=False, poll=poll, tick_s=0.001 if poll else 0.02)
    assert not w.hung, f"ranks {w.hung} still running after {deadline_s}s (killed)"
    results = {}
    for r, e in w.exits.items():
        f = tmp_path / f"rank{r}.json"
        results[r] = (
            json.loads(f.read_text())
            if f.exists()
            else {"ok": False, "error": f"no result, exit code {e.returncode}"}
        )
    return results


def as_main(main: Callable[[], object]) -> int:
    """Run ``main()`` as the interpreter runs a program: its ``SystemExit`` becomes the exit code, any
    other exception is printed (exit code 1), then the atexit hooks run (W&B, logging). Returns the
    exit code."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def module_main(rank: int, module: str, argv: list[str]) -> int:
    """``python -m <module> <argv>`` in this (rank) process; returns the exit code."""
    sys.argv = [module, *argv]
    return as_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


@dataclass
class Completed:
    """How a ``run_module`` process ended (as ``subprocess.CompletedProcess``)."""

    returncode: int | None
    stdout: str
    stderr: str


def torchrun_env(rank: int, world: int, master_port: int) -> dict[str, str]:
    """What torchrun sets for worker ``rank`` of ``world`` on one host (what dflash reads of it), with
    the store of rank 0 on ``master_port``."""
    ranks = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        **{k: str(v) for k, v in ranks.items()},
    }


def run_module(
    module: str,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    nproc: int = 1,
    stdio_dir: Path | None = None,
) -> Completed:
    """``python -m <module> <argv>`` as processes forked from the forkserver (not new interpreters:
    no second import of torch and transformers), with exactly ``env``; ``nproc`` > 1: that many
    ranks, each with torchrun's environment (``torchrun_env``). Killed after ``timeout`` seconds (then
    the test fails). The output (every rank's, in rank order) goes to ``stdio_dir`` (default: a
    temporary one); the exit code is the first failed rank's, or 0."""
    port = free_port()

    def rank_env(r: int) -> dict[str, str]:
        return {**env, **torchrun_env(r, nproc, port)} if nproc > 1 else env

    with tempfile.TemporaryDirectory(prefix="dflash-module-") as tmp:
        world = World(rank_specs(nproc, module_main, (module, argv), rank_env, cwd, stdio_dir or Path(tmp)))
        world.run(timeout, stop_peers_on_failure=nproc > 1)
        out, err = world.output()
    assert not world.hung, (
        f"python -m {module} did not finish within {timeout}s\n{out[-3000:]}\n{err[-3000:]}"
    )
    return Completed(world.returncode(), out, err)


def rank_specs(
    n: int,
    fn: Callable[..., int | None],
    args: tuple[Any, ...],
    env: Callable[[int], dict[str, str]],
    cwd: Path,
    stdio_dir: Path,
) -> list[RankSpec]:
    """``n`` ranks running ``fn(rank, *args)`` with ``env(rank)``, output in ``stdio_dir/rank{r}.{out,err}``."""
    stdio_dir.mkdir(parents=True, exist_ok=True)
    return [
        RankSpec(fn, args, env(r), str(cwd), str(stdio_dir / f"rank{r}.out"), str(stdio_dir / f"rank{r}.err"))
        for r in range(n)
    ]


# ---------------------------------------------------------------------------------------------
# The rank server: torchrun's workers as forks of the forkserver (tests/rank_exit.py asks it)

RANK_SERVER_ENV = "DFLASH_RANK_SERVER"
"""The variable that gives tests/rank_exit.py the rank server's address."""

_server: tuple[World, str] | None = None
_server_lock = threading.Lock()


def rank_server() -> str:
    """The address of the session's rank server, started (from the forkserver) on the first call."""
    global _server
    with _server_lock:
        if _server is None:
            root = Path(tempfile.mkdtemp(prefix="dflash-rank-server-"))
            address = str(root / "socket")
            world = World(
                rank_specs(1, serve_ranks, (address,), lambda r: dict(os.environ), Path.cwd(), root)
            )
            world.start()
            atexit.register(world.kill)  # before multiprocessing's own exit hook joins it
            deadline = time.monotonic() + 120
            while not os.path.exists(address):
                world._reap(0.05)
                if not world.alive() or time.monotonic() > deadline:  # its stderr exists once it runs
                    err = Path(world.specs[0].stderr)
                    raise AssertionError(
                        f"the rank server did not start:\n{err.read_text(errors='replace') if err.exists() else ''}"
                    )
            _server = (world, address)
        return _server[1]


def serve_ranks(rank: int, address: str) -> int:
    """The rank server's loop: a handler process per connection (``_handle``), reaped by the kernel."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(address + ".new")
        server.listen(64)
        os.rename(address + ".new", address)  # the address exists once it accepts connections
        while True:
            conn, _ = server.accept()
            if os.fork() == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                die_with_parent()
                try:
                    _handle(conn)
                finally:
                    os._exit(0)
            conn.close()


def _handle(conn: socket.socket) -> None:
    """One request of tests/rank_exit.py (``ServedRank``): ``{"fn": "module:name", "args", "env",
    "cwd"}`` and its stdin/stdout/stderr. Forks the rank (a session of its own, that environment,
    those fds) to run ``fn(RANK, *args)``, answers its pid, then its exit code (< 0: killed by that
    signal); the rank is SIGKILLed if the requester goes away first."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        assert chunk, "tests/rank_exit.py closed the connection before its request was complete"
        data += chunk
    req = json.loads(data)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            conn.close()
            die_with_parent()
            os.setsid()
            for fd, std in zip(fds, (0, 1, 2), strict=True):
                os.dup2(fd, std)
                os.close(fd)
            _enter(req["env"], req["cwd"])
            module, name = req["fn"].split(":")
            code = getattr(importlib.import_module(module), name)(int(req["env"]["RANK"]), *req["args"]) or 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    done = threading.Event()

    def kill_when_orphaned() -> None:
        if not conn.recv(1) and not done.is_set():  # EOF: the requester died
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    threading.Thread(target=kill_when_orphaned, daemon=True).start()
    _, status = os.waitpid(pid, 0)
    done.set()
    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


class ServedRank:
    """A rank the rank server forks for this process (tests/rank_exit.py): this process's stdin,
    stdout, stderr, environment and working directory; ``fn`` is ``"module:name"``."""

    def __init__(self, address: str, fn: str, args: list[Any]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address)
        req = {"fn": fn, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(self.sock, [json.dumps(req).encode() + b"\n"], [0, 1, 2])
        self.replies = self.sock.makefile("rb")
        self.pid = int(json.loads(self.replies.readline())["pid"])

    def send_signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        """The rank's exit code (< 0: killed by that signal)."""
        line = self.replies.readline()
        assert line, "the rank server went away"
        return int(json.loads(line)["returncode"])
