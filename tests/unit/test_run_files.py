"""What a run keeps in its directory, in-process: step logs, the lock, resume choices, secrets, summary."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from dflash.cli import RUN_ID_KEY, launch_run_id
from dflash.config import TrainConfig, UserError
from dflash.config.secrets import REDACTED, SecretFilter, config_secret_problems, redact
from dflash.train.run_dir import RunDirLock, move_aside, resume_checkpoint
from dflash.train.steplog import StepLog
from dflash.train.summary import balance_line, best_split, status_line, step_line


def test_step_log_truncate_drops_later_steps_and_a_torn_tail(tmp_path):
    log = StepLog(tmp_path / "ledger.jsonl")
    for s in range(1, 6):
        log.append({"step": s, "packets": [s]})
    with open(log.path, "a") as fh:
        fh.write('{"step": 6, "packets": [')  # torn by a full disk
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4, 5]
    assert log.truncate(3) == 3  # steps 4, 5 and the torn line
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2, 3]
    assert log.truncate(3) == 0  # nothing to drop: the file is left alone
    with pytest.raises(ValueError, match="step"):
        log.append({"packets": []})


def test_a_damaged_middle_line_is_set_aside_never_used_to_truncate(tmp_path, caplog):
    """Issue 19 item 4: a garbled line 10 of 60 (newline kept) no longer cuts the file to 9 lines."""
    log = StepLog(tmp_path / "metrics.jsonl", step_key="train/step")
    for s in range(1, 61):
        log.append({"train/step": s, "train/loss": 1.0 / s})
    lines = log.path.read_bytes().splitlines(keepends=True)
    lines[9] = b'{"train/step": 10, "train/lo\x00ss":: garbage\n'
    log.path.write_bytes(b"".join(lines))
    assert [r["train/step"] for r in log.records()] == [s for s in range(1, 61) if s != 10]
    assert log.damaged_lines == [10]
    with caplog.at_level("WARNING"):
        assert log.truncate(60) == 1
    assert "line(s) 10 are damaged" in caplog.text and "metrics.jsonl" in caplog.text
    kept = [json.loads(x)["train/step"] for x in log.path.read_text().splitlines()]
    assert kept == [s for s in range(1, 61) if s != 10]
    aside = [json.loads(x) for x in (tmp_path / "metrics.jsonl.damaged").read_text().splitlines()]
    assert aside == [{"line": 10, "text": lines[9].decode(errors="replace")}]
    assert log.truncate(30) == 30 and [r["train/step"] for r in log.records()][-1] == 30


def test_run_files_are_never_written_through_a_symbolic_link(tmp_path):
    """Issue 19 item 2: every entry the run writes is refused when it is a link out of the run
    directory, and the rank log handler and the step logs never open a link."""
    import logging

    from dflash.files import NoFollowFileHandler, append_line
    from dflash.train.run_dir import run_dir_problems

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    victims = {}
    for name in (".dflash.lock", "metrics.jsonl", "ledger.jsonl", "rank2.log", "checkpoints"):
        victim = outside / name
        if name == "checkpoints":
            (victim / "step_00000001").mkdir(parents=True)
            (victim / "step_00000001" / "precious.txt").write_text("keep me")
        else:
            victim.write_text("precious\n")
        (run / name).symlink_to(victim)
        victims[name] = victim
    problems = run_dir_problems(run)
    assert len(problems) == 5 and all("is a symbolic link" in p for p in problems)
    assert any(str(run / "checkpoints") in p for p in problems)
    with pytest.raises(OSError):
        append_line(run / "ledger.jsonl", "{}", follow_symlinks=False)
    with pytest.raises(OSError):
        StepLog(run / "metrics.jsonl").append({"step": 1})
    handler = NoFollowFileHandler(str(run / "rank2.log"))
    handler.handle(logging.makeLogRecord({"msg": "a log line"}))
    handler.close()
    assert handler.refused
    with pytest.raises(OSError):  # the job names the link first (run_dir_problems); the lock never follows it
        RunDirLock(run).acquire()
    for name, victim in victims.items():
        if name == "checkpoints":
            assert (victim / "step_00000001" / "precious.txt").read_text() == "keep me"
        else:
            assert victim.read_text() == "precious\n", name
    (run / "drafter").write_text("not a directory")
    assert any("is a file where the run keeps its drafter/ directory" in p for p in run_dir_problems(run))


def test_run_dir_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    first = RunDirLock(tmp_path).acquire()
    try:
        with pytest.raises(UserError) as err:
            RunDirLock(tmp_path).acquire()
        assert f"hydra.run.dir={tmp_path} is in use by another launch" in str(err.value)
        assert f'"pid": {os.getpid()}' in str(err.value) and err.value.scope == "here"
    finally:
        first.release()
    with RunDirLock(tmp_path):  # released: free again
        pass


def test_resume_never_refuses_another_runs_outputs_unless_overwrite(tmp_path):
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "ledger.jsonl").write_text('{"step": 1}\n')
    never = TrainConfig(resume="never")
    with pytest.raises(UserError, match="holds another run's outputs \\(checkpoints, ledger.jsonl\\)"):
        resume_checkpoint(tmp_path, never, {}, str, is_leader=True)
    assert (tmp_path / "checkpoints").exists()
    assert (
        resume_checkpoint(tmp_path, TrainConfig(resume="never", overwrite=True), {}, str, is_leader=True)
        is None
    )
    (aside,) = (tmp_path / "replaced").iterdir()
    assert (aside / "checkpoints" / "step_00000002").is_dir() and (aside / "ledger.jsonl").exists()
    assert not (tmp_path / "checkpoints").exists()
    assert move_aside(tmp_path) != aside  # a second move never overwrites the first


def test_resume_from_a_missing_path_says_so(tmp_path):
    with pytest.raises(UserError, match="train.resume=/nope: no such checkpoint directory"):
        resume_checkpoint(tmp_path, TrainConfig(resume="/nope"), {}, str, is_leader=True)


def test_secrets_are_refused_in_configs_and_redacted_from_logs(monkeypatch, caplog):
    key = "wandb-secret-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", key)
    problems = config_secret_problems(
        {"logging": {"name": key, "project": "p"}},
        {"logging": {"name": "${oc.env:WANDB_API_KEY}", "project": "p"}},
    )
    assert len(problems) == 1 and "logging.name holds the value of the secret WANDB_API_KEY" in problems[0]
    assert key not in problems[0]
    assert redact(f"a {key} b") == f"a {REDACTED} b"
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "bad value %r", (key,), None)
    SecretFilter().filter(record)
    assert key not in record.getMessage() and REDACTED in record.getMessage()


def test_run_id_is_shared_through_torchruns_store(monkeypatch):
    """Without a rendezvous id (torchrun's ``none``) the first rank to ask sets the id in the agent's
    store and every other rank (and restart) reads the same one."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    first, second = launch_run_id(), launch_run_id()
    assert first == second == store.get(RUN_ID_KEY).decode() and first != "none"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert launch_run_id() == "abc123"


def test_summary_lines():
    m = {
        "train/step": 10.0,
        "train/loss": 6.1234,
        "train/tau_hat": 1.234,
        "train/acc": 0.4,
        "perf/tokens_per_s": 456.0,
        "comm/recv_wait_frac": 0.03,
    }
    assert step_line(m, 145).startswith(
        "step 10/145  loss 6.1234  tau_hat 1.234  acc 0.400  tok/s 456  wait 3%"
    )
    assert status_line(145, 145, None) == "finished: 145 of 145 steps"
    assert (
        status_line(51, 505, "SIGTERM")
        == "stopped at step 51 of 505 (SIGTERM); relaunch the same command to resume"
    )
    assert best_split(8, 1.0, 1.6) == (3, 3.0)  # 3 targets x 1 packet/s vs 5 drafters / 1.6 s
    rows = [
        {
            "perf/target_s_per_packet": 1.0,
            "perf/drafter_s_per_packet": 1.6,
            "perf/target_busy_frac": 0.2,
            "comm/recv_wait_frac": 0.02,
            "perf/step_s": 1.6,
        }
    ] * 4
    line = balance_line(rows, 7, 1, self_produced=False)
    assert line == (
        "targets busy 20% (idle 80%), drafters waited 2%: 3 targets + 5 drafters would be ~4.8x faster "
        "(measured 1s per target forward, 1.6s per drafter packet)"
    )
    # Issue 19 item 12: targets work ahead, so one step's fraction can pass 1; the line never says 118%.
    ahead = [
        dict(rows[0], **{"perf/target_busy_frac": b, "perf/step_s": t}) for b, t in ((1.5, 1.0), (1.0, 1.0))
    ]
    assert balance_line(ahead, 1, 1, self_produced=False).startswith("targets busy 100% (idle 0%)")
    assert "per packet: target forward 1s + drafter 1.6s" in balance_line(rows, 0, 8, self_produced=True)
