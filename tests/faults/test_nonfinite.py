"""R6: a NaN loss at step 3. With train.on_nonfinite=error the run stops naming the step and the rank,
and the previous checkpoint stays intact; with skip, that step leaves the weights unchanged and is
counted. Between the two, the resume contract: a changed target.layer_ids is refused naming the field
and both values; a changed train.num_steps is accepted with train.allow_contract_change=true, logged."""

from __future__ import annotations

import json
import re

import pytest
import torch
from faultkit import figure, log_time
from runner import launch, no_leftover_processes, prepare_fast
from safetensors.torch import load_file
from wandb_reader import read_history

from dflash.train.checkpoint import load_checkpoint
from dflash.train.trainer import EMPTY_STEPS_LIMIT

pytestmark = pytest.mark.faults

# 1 target + 1 drafter (the guard and the contract live on the drafter): fewer processes to start.
NAN = ["topology.num_targets=1", "train.save_every=1", "train.keep_checkpoints=4", "fault.nan_at_step=3"]


def _weights(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def test_nan_loss_error_then_contract_then_skip(tmp_path, run_cache):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    failed = launch(run_dir, [*NAN, "train.max_steps=4", "logging.mode=disabled"], run_cache, nproc=2)
    assert failed.returncode != 0
    log = failed.rank_log(1)
    err = [ln for ln in log.splitlines() if ln.startswith("RuntimeError: drafter rank 1:")]
    assert err and "not finite at step 3" in err[-1] and "optimizer step was not applied" in err[-1], log[
        -2000:
    ]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]
    intact = load_checkpoint(ckpts / "step_00000002")  # verifies every file against its COMPLETE marker
    assert intact.step == 2
    exits = failed.exits()
    raised = log_time(log, "rank 1 failed")
    all_exit_s = max(e["end"] for e in exits.values()) - raised
    assert all(e["returncode"] != 0 for e in exits.values()) and all_exit_s <= 30
    figure(
        "R6 NaN loss, train.on_nonfinite=error",
        error=err[-1],
        exit_codes={r: e["returncode"] for (r, _), e in exits.items()},
        all_ranks_exit_after_error_s=round(all_exit_s, 1),
        previous_checkpoint="step 2 verified and loaded",
    )

    # The resume contract, against the intact step-2 checkpoint.
    refused = launch(
        run_dir,
        [*NAN, "train.max_steps=4", "logging.mode=disabled", "target.layer_ids=[1,3,4]"],
        run_cache,
        nproc=2,
    )
    assert refused.returncode != 0
    log = refused.rank_log(1)
    assert "the checkpoint was written by a run with a different contract" in log
    changed = "target.layer_ids: saved=[1, 2, 4] current=[1, 3, 4]"
    assert changed in log, log[-3000:]
    assert "train.allow_contract_change=true" in log
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]

    skipped = launch(
        run_dir,
        [*NAN, "train.max_steps=5", "train.on_nonfinite=skip", "train.allow_contract_change=true"],
        run_cache,
        nproc=2,
    )
    assert skipped.returncode == 0, skipped.output[-4000:]
    log = skipped.rank_log(1)
    allowed = "resuming with a changed contract (train.allow_contract_change=true): train.num_steps: saved=4 current=5"
    assert allowed in log and "at step 2" in log
    assert "step 3: loss or gradient not finite on drafter rank 1; step skipped" in log
    w2, w3, w4 = (_weights(ckpts / f"step_{s:08d}") for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # the NaN step changed nothing
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)  # the next one trains again
    rows = {int(r["train/step"]): r for r in read_history(run_dir)}
    assert [rows[s]["train/nonfinite_steps"] for s in (3, 4, 5)] == [1, 1, 1]
    assert json.loads((ckpts / "step_00000005" / "train_state.json").read_text())["nonfinite_steps"] == 1
    figure("R6 NaN loss, train.on_nonfinite=skip", weights_step2_equal_step3=True, nonfinite_steps=1)
    figure("contract", refused=changed, allowed=allowed.split(": ", 1)[1])
    assert no_leftover_processes(failed, refused, skipped)


@pytest.mark.parametrize(
    ("skip_fraction", "error"),
    [
        ("0.1", "non-finite hidden states, more than data.max_skip_fraction=0.1"),
        ("1.0", "trained on nothing: no packet held a supervised slot"),
    ],
)
def test_a_run_whose_hidden_states_are_all_non_finite_fails_without_an_export(
    tmp_path, run_cache, skip_fraction, error
):
    """Every sample's target hidden states NaN (a broken target checkpoint): the run stops with an
    error naming the cause, exports no drafter and never prints 'finished'. Within
    ``data.max_skip_fraction`` the drops count against it; when the user allows every sample to be
    dropped, ``EMPTY_STEPS_LIMIT`` steps in a row with no supervised slot end it."""
    num_samples = len(prepare_fast(run_cache).dataset)
    every = ",".join(str(i) for i in range(num_samples))
    run_dir = tmp_path / "run"
    run = launch(
        run_dir,
        [
            "topology.num_targets=1",
            "train.max_steps=6",
            "logging.mode=disabled",
            f"data.max_skip_fraction={skip_fraction}",
            f"fault.nonfinite_sample_ids=[{every}]",
        ],
        run_cache,
        nproc=2,
    )
    log = run.rank_log(1)
    assert run.returncode not in (0, None) and run.exits()[(1, 0)]["returncode"] != 0, log[-3000:]
    assert error in log, log[-3000:]
    assert "finished:" not in run.output and not (run_dir / "drafter").exists()
    step = re.search(r"steps (\d+)-(\d+) trained on nothing", log)
    if step:
        assert int(step[2]) - int(step[1]) + 1 == EMPTY_STEPS_LIMIT
    figure(
        f"train on nothing, data.max_skip_fraction={skip_fraction}",
        error=next(ln for ln in log.splitlines() if error in ln)[-200:],
        exported=False,
    )
    assert no_leftover_processes(run)
