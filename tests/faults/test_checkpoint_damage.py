"""R8: the newest checkpoints damaged (one truncated, one with a flipped byte): resume names each
damaged file, falls back to the last complete one and continues exactly like the reference run.
(All checkpoints damaged -> an error naming every file: tests/unit/test_checkpoint.py.)"""

from __future__ import annotations

import shutil

import pytest
from faultkit import STEPS, assert_continues_reference, figure, resumed_step
from runner import launch, no_leftover_processes

pytestmark = pytest.mark.faults


@pytest.mark.slow  # it reads R2's torchrun run (tests/faults/conftest.py)
def test_damaged_newest_checkpoints_fall_back_to_the_last_good_one(
    tmp_path, run_cache, killed_target_run, reference
):
    assert killed_target_run.returncode == 0, killed_target_run.output[-3000:]
    run_dir = tmp_path / "run"
    # R2's finished run dir without its logs, W&B files and export: only this launch writes those.
    shutil.copytree(
        killed_target_run.run_dir,
        run_dir,
        ignore=shutil.ignore_patterns("wandb", "rank_exits", "drafter", "rank*.log"),
    )
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000008", "step_00000012"]
    truncated = ckpts / "step_00000012" / "optimizer.pt"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    flipped = ckpts / "step_00000008" / "model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))

    run = launch(run_dir, STEPS, run_cache)
    assert run.returncode == 0, run.output[-4000:]
    log = run.rank_log(2)
    assert f"checkpoint {ckpts / 'step_00000012'} is damaged" in log and f"{truncated}: size" in log, log[
        -3000:
    ]
    assert f"checkpoint {ckpts / 'step_00000008'} is damaged" in log and f"{flipped}: sha256 mismatch" in log
    assert resumed_step(log) == 4
    assert_continues_reference(run, reference, 4, logged_from=5)
    named = [
        ln.split("is damaged")[0].split("checkpoint ")[-1] for ln in log.splitlines() if "is damaged" in ln
    ]
    figure(
        "R8 damaged checkpoints",
        damaged=["step 12: optimizer.pt truncated", "step 8: model.safetensors 1 byte flipped"],
        logged=named,
        resumed_from_step=4,
        equal_loss_steps="5-12",
        silent_loads=0,
    )
    assert no_leftover_processes(run)
