"""Metric logging (W&B or nothing), peak memory, device timing and the progress bar.

Device timing never calls ``torch.cuda.synchronize``: it waits for every stream of the device,
NCCL's included, and a rank always has point-to-point work pending that only a peer completes (a
target's control receive, a drafter's prefetched packet), so it would charge the peer's time to the
phase or deadlock (``tests/nccl_sim.py`` models it). ``sync_current_stream``, ``DeviceClock`` (CUDA
events) and ``PhaseTimer`` wait for the current stream only.

Only the drafter leader logs. Every other rank, and ``logging.mode=disabled``, gets a
``NullLogger``. ``WandbLogger`` follows these rules:

- The mode (online, offline or disabled) is always passed to ``wandb.init``, so the config decides
  and ``WANDB_MODE`` cannot override it.
- Every row carries ``train/step``, and every key is plotted against it
  (``define_metric("*", step_metric="train/step")``). We never pass ``step=`` to ``run.log``,
  because wandb silently drops rows whose ``step=`` is not increasing, which happens after a resume.
- The run id is stored in ``<run_dir>/wandb_run_id``, and the trainer also saves it in its
  TrainState. A resumed launch therefore continues the same W&B run (``resume="allow"``).
- It never captures secrets. The API key comes only from the environment (wandb reads
  ``WANDB_API_KEY`` itself). argv, program, git, code, host, requirements and console capture are
  all off (see ``_wandb_settings``). Config values that hold the value of a secret environment
  variable are redacted.
- W&B never stops a run. ``wandb.init`` may take ``logging.init_timeout_s``; when an online run
  cannot start (no network, a server that does not answer, a key W&B refuses), or when W&B fails
  during the run (a ``log`` call raising: its service died), the run goes on logging offline to
  ``<run_dir>/wandb`` under the same run id, after one warning naming the cause (the variable
  ``WANDB_API_KEY``, never its value) and the ``wandb sync`` command that uploads it later; if even
  offline logging fails, W&B is off for the rest of the run (``metrics.jsonl`` has every row). A
  full disk under the run directory at ``wandb.init`` is a ``DiskFull`` (one line, exit 2).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

import torch

from dflash.config import LoggingConfig
from dflash.config.secrets import redact, redact_config
from dflash.files import atomic_write, disk_full_error

if TYPE_CHECKING:
    from tqdm import tqdm

logger = logging.getLogger(__name__)

STEP_KEY = "train/step"
RUN_ID_FILE = "wandb_run_id"
SUMMARY_METRICS: dict[str, str] = {
    "train/loss": "min,last",
    "train/tau_hat": "max,last",
}
"""Keys whose W&B summary keeps the best value as well as the last one."""

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@runtime_checkable
class MetricLogger(Protocol):
    run_id: str | None
    mode: str
    """Where rows go now: online, offline or disabled (offline after a fallback from online)."""
    fallback: str | None
    """Why W&B logging fell back to offline or off during this launch (None: it did not)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


class NullLogger:
    """Logs nothing. Used on non-leader ranks and with ``logging.mode=disabled``."""

    run_id: str | None = None
    mode = "disabled"
    fallback: str | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def summary(self, values: dict[str, float]) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(exit_code=1 if exc[0] is not None else 0)


def _wandb_settings(wandb: Any, init_timeout_s: float) -> Any:
    """Settings that keep secrets, argv and the environment out of every W&B file.

    Checked on the wandb version pyproject.toml pins (0.31.x: the secrets test reads every file a
    run writes); ``x_disable_meta`` is an experimental setting, hence the pin.

    ``x_disable_meta`` stops wandb-core from collecting the metadata record. That record holds
    argv, program path, executable, host, OS, git remote/commit, cwd and hardware; without this
    setting argv shows up verbatim in the ``.wandb`` file. The other settings turn off code
    saving, git probing, pip freeze (index URLs with credentials), console capture (anything the
    process prints) and the W&B Launch job artifact.
    """
    return wandb.Settings(
        x_disable_meta=True,
        save_code=False,
        disable_code=True,
        disable_git=True,
        x_save_requirements=False,
        console="off",
        disable_job_creation=True,
        silent=True,  # no banner and no end-of-run block: the run prints its own summary
        init_timeout=init_timeout_s,
    )


def _read_run_id(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if _RUN_ID_RE.match(text):
        return text
    logger.warning("ignoring invalid W&B run id %r in %s; starting a new run id", text[:80], path)
    return None


def _new_run_id() -> str:
    """An 8-character base-36 id, the form wandb generates."""
    import secrets

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def sync_command(run_dir: Path) -> str:
    """The shell command that uploads the offline W&B runs of ``run_dir`` (shell-quoted; the glob
    after the quoted directory stays outside the quotes)."""
    return f"wandb sync {quote(str(Path(run_dir) / 'wandb'))}/offline-run-*"


def _why_wandb_failed(err: BaseException, cfg: LoggingConfig) -> str:
    """One line on why W&B failed: the key (named by its variable, never its value), the server's
    silence, or the error's first line (secret values redacted)."""
    name = type(err).__name__
    first = redact(str(err).strip().splitlines()[0] if str(err).strip() else "")
    if name == "AuthenticationError" or "api key" in first.lower():
        return f"the API key in WANDB_API_KEY was refused ({name}: {first}); check the variable (wandb.ai/authorize)"
    if name == "CommError" or "timed out" in first.lower():
        return f"no answer within logging.init_timeout_s={cfg.init_timeout_s:g} ({name}: {first})"
    return f"{name}: {first}"


class WandbLogger:
    """W&B run of the drafter leader; see the module docstring for the rules it follows."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        config: dict,
        run_name: str,
        resume_id: str | None = None,
    ) -> None:
        import wandb  # lazy: most processes never log

        self.cfg = cfg
        self.mode = str(cfg.mode)
        self.fallback: str | None = None
        self.run_dir = Path(run_dir)
        self._closed = False
        if resume_id is not None and not _RUN_ID_RE.match(resume_id):
            raise ValueError(f"W&B resume id {resume_id!r} must match {_RUN_ID_RE.pattern}")

        if cfg.mode == "disabled":
            # No files at all: no run-id file, and wandb's disabled mode writes nothing.
            self.run_id = resume_id
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            id_file = self.run_dir / RUN_ID_FILE
            self.run_id = resume_id or _read_run_id(id_file) or _new_run_id()
            if _read_run_id(id_file) != self.run_id:
                atomic_write(id_file, self.run_id + "\n")
        self._init_args = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_name,
            id=self.run_id,
            resume="allow",
            config=redact_config(config),
            settings=_wandb_settings(wandb, cfg.init_timeout_s),
            reinit="create_new",
        )
        try:
            self.run: Any = self._start(self.mode)
        except Exception as e:
            full = disk_full_error(
                e, self.run_dir / "wandb", "free space there, or put the run on a larger disk"
            )
            if full is not None:
                raise full from None
            self._fall_back(e, "could not start")
        if self.mode != "disabled":
            logger.info("W&B %s run %s in %s", self.mode, self.run_id, self.run_dir)

    def _start(self, mode: str) -> Any:
        """``wandb.init`` in ``mode``, with the run's metric definitions."""
        import wandb

        run = wandb.init(
            mode=cast(Literal["online", "offline", "disabled"], mode),
            dir=None if mode == "disabled" else str(self.run_dir),  # disabled: wandb would mkdir it
            **self._init_args,
        )
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        for key, ops in SUMMARY_METRICS.items():
            run.define_metric(key, step_metric=STEP_KEY, summary=ops)
        return run

    def _fall_back(self, err: BaseException, when: str) -> None:
        """After W&B failed (``when``): one warning, then the rest of the run offline under the same
        run id (wandb's service restarted), or with W&B off if offline fails too."""
        import wandb

        why = _why_wandb_failed(err, self.cfg)
        self.run = None
        try:
            wandb.teardown()  # the failed run holds the run id (and maybe a dead service)
        except Exception:
            pass
        if self.mode != "disabled" and self.fallback is None:
            try:
                self.run = self._start("offline")
                self.mode = "offline"
            except Exception as again:
                why += f"; offline logging failed too ({type(again).__name__}: {redact(str(again))[:200]})"
        if self.run is None:
            self.mode = "disabled"
            where = f"W&B is off for the rest of the run; {self.run_dir / 'metrics.jsonl'} keeps every row"
        else:
            where = f"logging to W&B offline in {self.run_dir / 'wandb'}; upload it later: {sync_command(self.run_dir)}"
        self.fallback = f"logging.mode={self.cfg.mode}: {why}"
        logger.warning("W&B %s: %s; %s", when, why, where)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        row: dict[str, Any] = {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            row[k] = v
        row[STEP_KEY] = int(step)
        try:
            self.run.log(row)
        except Exception as e:
            self._fall_back(e, f"stopped taking rows at step {int(step)}")
            if self.run is not None:
                self.run.log(row)

    def summary(self, values: dict[str, float]) -> None:
        if self.run is None:
            return
        values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        try:
            self.run.summary.update(values)
        except Exception as e:
            self._fall_back(e, "failed writing the run summary")
            if self.run is not None:
                self.run.summary.update(values)

    def close(self, exit_code: int = 0) -> None:
        """Finish the run (idempotent). A non-zero ``exit_code`` marks the run as failed. A W&B that
        fails here is a warning, never the run's failure."""
        if self._closed:
            return
        self._closed = True
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:
            logger.warning("W&B could not finish the run (%s: %s)", type(e).__name__, redact(str(e))[:200])
        if self.mode != "disabled":
            _flush_wandb_service()

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(exit_code=1 if exc[0] is not None else 0)


def _flush_wandb_service() -> None:
    """Wait until wandb-core has written everything to disk.

    In wandb 0.31, ``run.finish()`` returns before the ``.wandb`` file is complete: the service
    is told that the run is finished (fire and forget) and flushes the file later. In pytest, a
    read right after ``finish()`` found only the 7-byte header. ``wandb.teardown()`` waits for
    the service process to exit. It runs only when no other run of this process is active,
    because teardown would finish those too (read from ``wandb_setup``'s private state: the pinned
    wandb 0.31.x has no public way to list active runs).
    """
    import wandb

    try:
        from wandb.sdk import wandb_setup

        singleton = getattr(wandb_setup, "_singleton", None)
        if singleton is not None and getattr(singleton, "_active_runs", None):
            return
        wandb.teardown()
    except Exception:  # best effort: never fail a training run at its very end
        logger.warning("wandb teardown failed", exc_info=True)


def default_run_name(run_dir: Path) -> str:
    """The W&B run name without ``logging.name``: the run directory's last two parts
    (``outputs/cmp/A_base`` -> ``cmp/A_base``; the default ``outputs/<experiment>/<run id>`` ->
    ``<experiment>/<run id>``), so runs of one experiment in several directories read apart."""
    parts = Path(run_dir).resolve().parts
    return "/".join(parts[-2:])


def build_logger(
    cfg: LoggingConfig,
    is_leader: bool,
    run_dir: Path,
    config: dict,
    run_name: str,
    resume_id: str | None = None,
) -> MetricLogger:
    """A WandbLogger on the drafter leader (unless ``logging.mode=disabled``), else a NullLogger."""
    if not is_leader or cfg.mode == "disabled":
        return NullLogger()
    return WandbLogger(cfg, Path(run_dir), config, run_name, resume_id=resume_id)


# --------------------------------------------------------------------------------------------
# Memory, timing, progress


def _proc_status_bytes(field: str) -> int | None:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_peak_rss_bytes() -> int:
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory since the last reset, in GiB.

    CUDA: ``max_memory_allocated`` (tensor memory). CPU: the peak resident set size of the
    whole process (VmHWM), which includes Python, libraries and allocator caches.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _cpu_peak_rss_bytes() / 2**30


def memory_gib(device: torch.device | str) -> float:
    """Memory in use now, in GiB, what :func:`peak_memory_gib` counts: CUDA ``memory_allocated``;
    CPU the resident set size of the whole process (VmRSS; 0 where /proc is not there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return (_proc_status_bytes("VmRSS") or 0) / 2**30


def reset_peak_memory(device: torch.device | str) -> None:
    """Reset the peak counter. On CPU this writes 5 to /proc/self/clear_refs (Linux), which
    resets VmHWM; where that is not allowed the CPU peak stays process-lifetime."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def sync_current_stream(device: torch.device) -> None:
    """Wait until the work queued on this device's current stream is done (nothing on CPU); never
    the device-wide ``torch.cuda.synchronize`` (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DeviceClock:
    """Seconds of the work queued on the current stream between ``start()`` and ``stop()``.

    CUDA: two timing events on the current stream; neither mark waits, and ``seconds()`` waits for
    the stop event only (free after any later sync of the stream, e.g. a device-to-host copy).
    Elsewhere the host clock between the two marks.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._events: list[Any] = []
        self._host = [0.0, 0.0]

    def _mark(self, i: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events[i:] = [event]
        else:
            self._host[i] = time.perf_counter()

    def start(self) -> None:
        self._mark(0)

    def stop(self) -> None:
        self._mark(1)

    def seconds(self) -> float:
        if self.device.type != "cuda":
            return self._host[1] - self._host[0]
        first, last = self._events
        last.synchronize()
        return first.elapsed_time(last) / 1000.0


class PhaseTimer:
    """Seconds spent in the named phases of a step: ``mark(name)`` charges the time since the previous
    mark (or ``start``) to ``name``. With ``sync`` on a CUDA device it first waits for the current
    stream (``sync_current_stream``), so queued kernels are charged to the phase that launched them
    (it costs a little throughput); never for the communication streams."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.device, self.sync = device, sync and device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        self.seconds = {}
        self._sync()
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def _sync(self) -> None:
        if self.sync:
            sync_current_stream(self.device)


@contextmanager
def progress_bar(
    total: int | None,
    initial: int,
    enabled: bool,
    desc: str = "train",
    unit: str = "step",
    *,
    nested: bool = False,
) -> Iterator[tqdm | None]:
    """A tqdm bar on stdout, where the console log goes (None when not ``enabled``); while it is
    open, console log records are written above it (``logging_redirect_tqdm``), not glued onto it.
    ``nested``: opened while another bar is open (the periodic eval's, under the training bar): it
    goes below that one and is cleared when closed."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(
        total=total,
        initial=initial,
        unit=unit,
        file=sys.stdout,
        dynamic_ncols=True,
        smoothing=0.1,
        desc=desc,
        leave=not nested,
    )
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger()]):
            yield bar
    finally:
        bar.close()


def human_count(n: float) -> str:
    """``1.05B``, ``12.3M``, ``45.6K`` or ``789``: parameter and token counts for logs."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
