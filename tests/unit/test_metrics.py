"""Metric logging: offline W&B read back from the .wandb file, disabled mode, run-id reuse on
resume, no secret in any file (R12), and the memory / timing / progress helpers."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_reader import find_wandb_files, read_wandb_run

from dflash.config import LoggingConfig
from dflash.config.secrets import redact_config
from dflash.metrics import (
    RUN_ID_FILE,
    NullLogger,
    WandbLogger,
    build_logger,
    human_count,
    progress_bar,
)

OFFLINE = LoggingConfig(mode="offline", project="dflash-test", progress_bar=False)
CONFIG = {"name": "unit", "optim": {"lr": 0.0006}, "target": {"layer_ids": [1, 3]}}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.fixture(autouse=True)
def _env_wandb_disabled(monkeypatch):
    # The config's mode must win over the environment.
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_offline_run_is_read_back(tmp_path):
    log = WandbLogger(OFFLINE, tmp_path, CONFIG, run_name="unit")
    for step, loss in ((1, 2.0), (2, 1.5), (3, 1.75)):
        log.log(
            {"train/loss": loss, "train/tau_hat": 1.0 + step / 10, "perf/tokens_per_s": 100.0 * step}, step
        )
    log.summary({"final/tokens_seen": 1234})
    log.close()
    log.close()  # idempotent

    run = read_wandb_run(tmp_path)
    assert run.run_id == log.run_id == (tmp_path / RUN_ID_FILE).read_text().strip()
    assert [r["train/step"] for r in run.history] == [1, 2, 3]
    assert [r["train/loss"] for r in run.history] == [2.0, 1.5, 1.75]
    assert {"train/loss", "train/tau_hat", "perf/tokens_per_s", "train/step"} <= set(run.history[0])
    assert run.config == CONFIG
    assert run.summary["train/loss"] == {"min": 1.5, "last": 1.75}
    assert run.summary["train/tau_hat"] == {"max": 1.3, "last": 1.3}
    assert run.summary["final/tokens_seen"] == 1234
    globs = {m["glob_name"]: m["step_metric"] for m in run.metrics if m["glob_name"]}
    assert globs == {"*": "train/step"}


def test_resume_reuses_run_id_and_keeps_earlier_steps(tmp_path):
    first = WandbLogger(OFFLINE, tmp_path, CONFIG, run_name="unit")
    first.log({"train/loss": 1.0}, 10)
    first.close()

    # A resumed launch (e.g. from step 5 after a crash at 10) continues the same run, and its
    # steps are kept even though they go backwards (no step= is passed to wandb).
    second = WandbLogger(OFFLINE, tmp_path, CONFIG, run_name="unit")
    assert second.run_id == first.run_id
    second.log({"train/loss": 0.9}, 6)
    second.log({"train/loss": 0.8}, 7)
    second.close()
    files = find_wandb_files(tmp_path)
    assert len(files) == 2 and all(f.name == f"run-{first.run_id}.wandb" for f in files)
    assert [r["train/step"] for r in read_wandb_run(tmp_path).history] == [6, 7]

    # The id saved in the checkpoint's TrainState wins over the file.
    third = WandbLogger(OFFLINE, tmp_path, CONFIG, run_name="unit", resume_id="fromckpt1")
    third.close()
    assert third.run_id == "fromckpt1" and (tmp_path / RUN_ID_FILE).read_text().strip() == "fromckpt1"
    assert read_wandb_run(tmp_path).run_id == "fromckpt1"


def test_disabled_and_non_leader_write_nothing(tmp_path):
    run_dir = tmp_path / "run"
    log = WandbLogger(LoggingConfig(mode="disabled"), run_dir, CONFIG, run_name="unit")
    log.log({"train/loss": 1.0}, 1)
    log.summary({"x": 1.0})
    log.close()
    assert list(tmp_path.iterdir()) == []

    for cfg, leader in ((LoggingConfig(mode="disabled"), True), (OFFLINE, False)):
        null = build_logger(cfg, is_leader=leader, run_dir=run_dir, config=CONFIG, run_name="unit")
        assert isinstance(null, NullLogger)
        null.log({"train/loss": 1.0}, 1)
        null.summary({"x": 1.0})
        null.close()
    assert list(tmp_path.iterdir()) == []


def test_api_key_and_argv_never_written(tmp_path, monkeypatch):
    key = "SENTINELKEY" + "0123456789abcdef" * 2 + "zz"  # 45 chars, like a real key
    argv_secret = "ARGVSENTINEL" + "42" * 8
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HF_TOKEN", "hf_SENTINELTOKEN1234")
    monkeypatch.setattr(sys, "argv", [*sys.argv, f"logging.token={argv_secret}"])
    config = dict(CONFIG, hub={"token": "hf_SENTINELTOKEN1234"}, note=f"key={key}")

    log = WandbLogger(OFFLINE, tmp_path, config, run_name="unit")
    log.log({"train/loss": 1.0}, 1)
    log.close()

    files = _files(tmp_path)
    assert any(f.suffix == ".wandb" for f in files)
    for needle in (key.encode(), b"SENTINELKEY", argv_secret.encode(), b"hf_SENTINELTOKEN"):
        hits = [str(f) for f in files if needle in f.read_bytes()]
        assert hits == [], f"{needle!r} found in {hits}"
    assert read_wandb_run(tmp_path).config["hub"] == {"token": "<redacted>"}


def test_redact_config(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    out = redact_config({"a": {"api_key": "x", "token_budget": 5, "list": ["k" * 40, 1]}, "token": None})
    assert out == {
        "a": {"api_key": "<redacted>", "token_budget": 5, "list": ["<redacted>", 1]},
        "token": None,
    }


_PEAK_PROBE = """
import json, torch
from dflash.metrics import peak_memory_gib, reset_peak_memory
cpu = torch.device("cpu")
reset_peak_memory(cpu)
before = peak_memory_gib(cpu)
buf = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)  # 64 MiB, every page touched
after = peak_memory_gib(cpu)
print(json.dumps([before, after]))
"""


def test_cpu_peak_memory_counts_a_new_buffer():
    # A fresh process: in a long pytest process, freed-but-resident heap memory can serve the
    # buffer without raising the RSS, which is not what this test is about.
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < before <= after
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return  # no reset: the peak is process-lifetime, only monotonicity holds
    assert after - before >= 48 / 1024


def test_progress_bar(capsys):
    with progress_bar(10, 0, enabled=False) as bar:
        assert bar is None
    with progress_bar(10, 4, enabled=True) as bar:
        assert bar is not None and bar.n == 4 and bar.total == 10
        bar.update(2)
    out = capsys.readouterr().out  # on stdout, where the console log goes
    assert "6/10" in out


def test_human_count():
    assert [human_count(n) for n in (789, 45_600, 12_300_000, 1_050_000_000)] == [
        "789",
        "45.6K",
        "12.3M",
        "1.05B",
    ]


# ---- W&B unreachable, refusing the key, or dying mid-run (issue 32, item 6): the run logs offline


def _closed_port_server(monkeypatch) -> None:
    """W&B's server on a port nothing listens on (connection refused at once), a well-formed key."""
    from ranks import free_port

    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "unreachable" + "0" * 33)  # well formed: 44 characters, no "-"


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "dflash.metrics"
    ]


def test_unreachable_server_goes_offline_within_the_timeout(tmp_path, monkeypatch, caplog):
    _closed_port_server(monkeypatch)
    cfg = LoggingConfig(mode="online", project="dflash-test", init_timeout_s=2)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dflash.metrics"):
        log = WandbLogger(cfg, tmp_path, CONFIG, run_name="unit")
    took = time.perf_counter() - t0
    for step in (1, 2):
        log.log({"train/loss": 3.0 - step}, step)
    log.close()
    assert took < 15, took  # was: 91 s in wandb.init, then a CommError traceback
    (warning,) = _warnings(caplog)
    assert "no answer within logging.init_timeout_s=2" in warning
    assert f"wandb sync {tmp_path / 'wandb'}/offline-run-*" in warning
    assert log.mode == "offline" and "logging.mode=online" in str(log.fallback)
    run = read_wandb_run(find_wandb_file_offline(tmp_path))
    assert run.run_id == log.run_id and [r["train/loss"] for r in run.history] == [2.0, 1.0]


def find_wandb_file_offline(run_dir: Path) -> Path:
    (f,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    return f


def test_a_key_wandb_refuses_is_named_by_its_variable_never_its_value(tmp_path, monkeypatch, caplog, capfd):
    _closed_port_server(monkeypatch)
    key = "MALFORMED" + "k" * 30  # 39 characters: wandb refuses it at login
    assert len(key) == 39
    monkeypatch.setenv("WANDB_API_KEY", key)
    cfg = LoggingConfig(mode="online", project="dflash-test", init_timeout_s=2)
    with caplog.at_level(logging.WARNING, logger="dflash.metrics"):
        log = WandbLogger(cfg, tmp_path, CONFIG, run_name="unit")
        log.log({"train/loss": 1.0}, 1)
        log.close()
    (warning,) = _warnings(caplog)
    assert "WANDB_API_KEY was refused" in warning and key not in warning
    assert (
        log.mode == "offline"
        and read_wandb_run(find_wandb_file_offline(tmp_path)).history[0]["train/loss"] == 1.0
    )
    out = capfd.readouterr()
    assert key not in out.out + out.err
    hits = [str(f) for f in _files(tmp_path) if key.encode() in f.read_bytes()]
    assert hits == []


def _kill_wandb_service() -> int:
    """SIGKILL this process's wandb-core children (W&B's service dying); returns how many."""
    me, killed = str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = stat.with_name("comm").read_text().strip()
        except OSError:
            continue
        if fields[1] == me and comm.startswith("wandb-core"):
            os.kill(int(stat.parent.name), signal.SIGKILL)
            killed += 1
    return killed


def test_wandb_dying_mid_run_continues_offline_with_one_warning(tmp_path, caplog):
    log = WandbLogger(OFFLINE, tmp_path, CONFIG, run_name="unit")
    log.log({"train/loss": 5.0}, 1)
    assert _kill_wandb_service() >= 1
    time.sleep(0.5)
    with caplog.at_level(logging.WARNING, logger="dflash.metrics"):
        for step in (2, 3, 4):
            log.log({"train/loss": 5.0 - step}, step)  # was: ConnectionResetError out of the training loop
        log.summary({"final/tokens_seen": 7})
        log.close()
    (warning,) = _warnings(caplog)
    assert "stopped taking rows at step 2" in warning and "wandb sync" in warning
    assert log.mode == "offline"
    runs = find_wandb_files(tmp_path)  # the dead service's file, then the new one, under the same id
    assert len(runs) == 2 and read_wandb_run(runs[-1]).run_id == log.run_id
    assert [r["train/step"] for r in read_wandb_run(runs[-1]).history] == [2, 3, 4]


def test_the_default_run_name_tells_runs_of_one_experiment_apart(tmp_path):
    """``logging.name`` unset: the run directory's last two parts, not the experiment's name (every
    ``hydra.run.dir=outputs/cmp/<x>`` run was called ``tiny_cpu``)."""
    from dflash.metrics import default_run_name

    assert default_run_name(tmp_path / "outputs" / "cmp" / "A_base") == "cmp/A_base"
    assert default_run_name(tmp_path / "outputs" / "tiny_cpu" / "6c77914c") == "tiny_cpu/6c77914c"
    assert default_run_name(tmp_path / "cmp" / "B" / ".") == "cmp/B"
