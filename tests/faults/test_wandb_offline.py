"""W&B that cannot be reached or refuses the key never stops a run (issue 32, item 6).

A real training job with ``logging=online``, W&B's server on a port nothing listens on (connection
refused at once) and ``logging.init_timeout_s=2``: with a well-formed key, then with a 39-character
one (wandb refuses it at login). Both train every step offline after one warning, the summary prints
the ``wandb sync`` command, and the key is in no output and no file of the run.
"""

from __future__ import annotations

import pytest
from faultkit import figure
from ranks import free_port
from runner import launch

pytestmark = pytest.mark.faults

QUICK = ["topology.num_targets=1", "train.max_steps=3", "logging=online", "logging.init_timeout_s=2"]


@pytest.mark.parametrize(
    "key,cause",
    [
        ("unreachablesentinel" + "0" * 25, "no answer within logging.init_timeout_s=2"),
        ("malformedsentinel" + "k" * 22, "the API key in WANDB_API_KEY was refused"),  # 39 characters
    ],
    ids=["server-unreachable", "key-refused"],
)
def test_online_run_without_wandb_trains_offline(tmp_path, run_cache, key, cause):
    run_dir = tmp_path / "run"
    env = {"WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}", "WANDB_API_KEY": key}
    run = launch(run_dir, QUICK, run_cache, nproc=2, env=env)
    assert run.returncode == 0, run.output[-3000:]  # was: a CommError / AuthenticationError traceback
    assert [e["step"] for e in run.ledger()] == [1, 2, 3]
    warnings = [ln for ln in run.output.splitlines() if "W&B could not start" in ln]
    assert len(warnings) == 1 and cause in warnings[0], run.output[-3000:]
    sync = f"wandb sync {run_dir / 'wandb'}/offline-run-*"
    (w_and_b,) = [ln for ln in run.output.splitlines() if ln.startswith("W&B ")]  # the summary's row
    assert "  offline (logging.mode=online: " in w_and_b and sync in w_and_b
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert key not in run.output
    files = [p for d in (run_dir, run.stdio_dir) for p in d.rglob("*") if p.is_file() and not p.is_symlink()]
    assert [str(p) for p in files if key.encode() in p.read_bytes()] == []
    figure(f"W&B offline: {cause}", seconds=round(run.seconds, 1), steps=3)
