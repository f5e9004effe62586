"""The entry point every command-line app shares: Hydra composition, checks, one readable error.

``run_app(config_name, schema, task)`` composes ``conf/<config_name>.yaml`` with Hydra and calls
``task(cfg, run_dir)``. Around it:
- composition errors (a typo, a wrong type) are printed by global rank 0 only: every rank of a
  torchrun launch composes the same command line, and one copy of the message is enough;
- a key the schema does not know (``+train.max_step=5``) and a secret in the config are refused
  before the task starts;
- a ``UserError`` is printed as its message alone (no traceback) by the rank its scope names,
  written to every rank's log, and the process exits with ``EXIT_USER_ERROR``; so is a full disk
  (``dflash.files.DiskFull``: the rank that met it prints it); any other exception is logged with
  its traceback, recorded for torchrun (``error.json``) and exits 1;
- secret values are redacted from every log record (``dflash.config.secrets``).

It also registers the ``${dflash.run_id:}`` resolver: the id of this launch, shared by all its
ranks and by torchrun restarts of it, unique per launch even when torchrun has no rendezvous id.
"""

from __future__ import annotations

import io
import logging
import os
import re
import secrets as stdlib_secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from dflash.config import EXIT_USER_ERROR, UserError
from dflash.config.checks import check_known_keys, free_form_overrides, override_key_problems
from dflash.config.help import render_help
from dflash.config.secrets import config_secret_problems, install_log_redaction, redact
from dflash.files import DiskFull
from dflash.versions import warn_untested_versions

log = logging.getLogger("dflash")

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
RUN_ID_KEY = "dflash/run_id"

Task = Callable[[DictConfig, Path], int | None]


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + stdlib_secrets.token_hex(3)


def launch_run_id() -> str:
    """torchrun's rendezvous id when it has one; else an id agreed through torchrun's store (the
    first rank to ask sets it, every other rank and every restart of the launch reads it); else,
    outside torchrun, a new timestamped id."""
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return rdzv
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and "MASTER_ADDR" in os.environ:
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=120),
        )
        return store.compare_set(RUN_ID_KEY, "", _new_run_id()).decode()
    return _new_run_id()


if not OmegaConf.has_resolver("dflash.run_id"):
    OmegaConf.register_new_resolver("dflash.run_id", launch_run_id, use_cache=True)


def _file_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def log_to_files(level: int, message: str) -> None:
    """Write one record to the rank's log file only (not to the console)."""
    rec = logging.getLogger("dflash").makeRecord("dflash", level, __file__, 0, message, (), None)
    for h in _file_handlers():
        h.handle(rec)


class _DropInfoFrom(logging.Filter):
    """Drops records below WARNING from the given logger name prefixes."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(self.prefixes)


def quiet_console(level: int, drop_info_from: tuple[str, ...] = ()) -> None:
    """Console handlers of this process show records of ``level`` and above, and no INFO of the
    loggers in ``drop_info_from`` (the rank log files keep everything)."""
    for h in logging.getLogger().handlers:
        if not isinstance(h, logging.FileHandler) and isinstance(h, logging.StreamHandler):
            h.setLevel(level)
            if drop_info_from:
                h.addFilter(_DropInfoFrom(drop_info_from))


def report_user_error(err: UserError, rank: int) -> None:
    """Print the message (no traceback) where its scope says, and write it to this rank's log."""
    message = redact(str(err))
    log_to_files(logging.ERROR, f"stopped: {message}")
    speaks = err.scope == "here" or (err.scope == "all" and rank == 0)
    if speaks:
        print(f"dflash: error: {message}", file=sys.stderr, flush=True)


@contextmanager
def value_errors_are_user_errors() -> Iterator[None]:
    """Inside: a ``ValueError`` (the project's convention for a config or data mistake, raised before
    anything runs) becomes a ``UserError``: one readable message, no traceback; so does a full disk
    (``DiskFull``), printed by the rank that met it (the one that built the cache entry: torchrun
    stops the others, which wait for its lock)."""
    try:
        yield
    except UserError:
        raise
    except DiskFull as e:
        raise UserError(str(e), scope="here") from None
    except ValueError as e:
        raise UserError(str(e)) from None


def _check_config(dcfg: DictConfig, schema: type) -> None:
    check_known_keys(dcfg, schema)
    resolved = OmegaConf.to_container(dcfg, resolve=True, throw_on_missing=False)
    unresolved = OmegaConf.to_container(dcfg, resolve=False)
    assert isinstance(resolved, dict) and isinstance(unresolved, dict)
    problems = config_secret_problems(
        {str(k): v for k, v in resolved.items()}, {str(k): v for k, v in unresolved.items()}
    )
    if problems:
        raise UserError("; ".join(problems))


@record
def _recorded(task: Task, dcfg: DictConfig, run_dir: Path) -> int | None:
    """The task under torchrun's error recorder: an internal error lands in ``error.json`` (secret
    values redacted from its message); a ``UserError`` is reported and becomes an exit code."""
    try:
        return task(dcfg, run_dir)
    except UserError as e:
        report_user_error(e, global_rank())
        return EXIT_USER_ERROR
    except DiskFull as e:
        report_user_error(UserError(str(e), scope="here"), global_rank())
        return EXIT_USER_ERROR
    except Exception as e:
        text = str(e)
        if redact(text) != text:
            clean = RuntimeError(f"{type(e).__name__}: {redact(text)}")
            clean.dflash_logged = getattr(e, "dflash_logged", False)  # type: ignore[attr-defined]
            raise clean from None
        raise


_COMPOSE_LOCK = threading.Lock()


def compose_config(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """``conf/<config_name>.yaml`` composed with ``overrides`` as that app's command line would, but
    outside the app (no run directory, no logging set-up): for tools that plan or launch runs and for
    tests. The schema the config names must be registered first (``register_configs()``, ...).
    Thread-safe: Hydra's global state is held for the call."""
    with _COMPOSE_LOCK, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_.+:@%-]*/[A-Za-z0-9_/.+:@%-]*")
"""A path Hydra reads unquoted as that string: ASCII letters, digits, ``_/.+:@%-`` and a slash (so
never a number, a boolean or null)."""


def hydra_quote(value: str) -> str:
    """``value`` written as a Hydra override value that composes to exactly the string ``value``: as
    it is when it is a plain path (``_HYDRA_PLAIN``), else single-quoted with Hydra's escapes
    (a quote, and backslashes before a quote or the closing one) and ``${`` escaped for OmegaConf
    (no interpolation). For a path given on a command line: ``run_dir=`` + ``hydra_quote(path)``."""
    if _HYDRA_PLAIN.fullmatch(value):
        return value
    body = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)  # OmegaConf's escape
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", body)  # then Hydra's quoting
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def _app_module() -> str:
    """The ``python -m`` module of this process (``dflash.train`` under torchrun)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None) or "dflash.train"
    return name.removesuffix(".__main__")


class _Swallow(io.StringIO):
    """stderr of the non-zero ranks while Hydra composes (rank 0 prints the same message)."""


class ConsoleStream(io.TextIOBase):
    """stdout/stderr that survive a reader that went away (``... | tee log`` and Ctrl-C: the pipe
    closes while the run still has a checkpoint to write). The first write or flush that finds the
    pipe closed points the stream's file descriptor at /dev/null; every later write is dropped, so a
    progress bar or a log line never raises ``BrokenPipeError`` in the middle of a stop."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.closed_by_reader = False

    def _gone(self) -> None:
        self.closed_by_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def write(self, s: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(s)
            except BrokenPipeError:
                self._gone()
        return len(s)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def isatty(self) -> bool:
        return not self.closed_by_reader and self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def run_app(config_name: str, schema: type, task: Task) -> None:
    """Compose ``conf/<config_name>.yaml`` and run ``task(cfg, run_dir)``; exits with its code."""
    rank = global_rank()
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), ConsoleStream):
            setattr(sys, name, ConsoleStream(getattr(sys, name)))
    real_stderr = sys.stderr
    started = False
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        if rank == 0:
            print(render_help(schema, _app_module()), end="", flush=True)
        raise SystemExit(0)
    sys.argv[1:] = free_form_overrides(sys.argv[1:], schema)
    unknown = override_key_problems(sys.argv[1:], schema)
    if unknown:
        if rank == 0:
            print(
                f"dflash: error: unknown config key(s): {'; '.join(unknown)}; fix the name "
                f"(python -m {_app_module()} --cfg job prints every key)",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(EXIT_USER_ERROR)
    if rank != 0:
        sys.stderr = _Swallow()

    def task_fn(dcfg: DictConfig) -> None:
        nonlocal started
        started = True
        sys.stderr = real_stderr
        install_log_redaction()
        if rank == 0:
            warn_untested_versions()
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            _check_config(dcfg, schema)
            code = _recorded(task, dcfg, run_dir)
        except UserError as e:
            report_user_error(e, rank)
            sys.exit(EXIT_USER_ERROR)
        except Exception as e:
            if not getattr(e, "dflash_logged", False):
                log.exception("rank %d failed", rank)
            sys.exit(1)
        if code:
            sys.exit(code)

    main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task_fn)
    try:
        main()
    except SystemExit as e:
        if not started and e.code == 1:  # Hydra rejected the command line: a user error
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
    except Exception:
        if started:
            raise
        # HYDRA_FULL_ERROR=1: Hydra re-raises composition errors; one rank shows the traceback.
        sys.stderr = real_stderr
        if rank == 0:
            traceback.print_exc()
        raise SystemExit(EXIT_USER_ERROR) from None
    finally:
        sys.stderr = real_stderr
