"""drafter.shard through the real job: 1 target + 2 drafters sharding the drafter (FSDP2 on gloo).

- a sharded run stopped at step 3 (under real torchrun) checkpoints with DCP (each drafter its own
  shard in ``state/``, no whole-tensor files) and, resumed from it, ends bitwise equal to the straight
  sharded run (weights, ledger, losses);
- the same checkpoint resumed on one drafter taking both packets of a step (``optim.grad_accum_steps=2``:
  the same packets per step, the shards read whole) trains the same packets and ends within 1e-5
  of the straight run; on 3 drafters (3 packets per step) it is refused in one line, exit 2;
- an unsharded run's step-3 checkpoint resumed sharded (``drafter.shard`` is not in the run
  contract: checkpoints of whole tensors load into shards) ends within 1e-5 of the straight sharded run;
- with one drafter the setting has nothing to shard: the run says so and trains unsharded.
"""

from __future__ import annotations

import json

import pytest
import torch
from faultkit import figure, losses, resumed_step
from runner import launch
from safetensors.torch import load_file

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # seven launches

COMMON = ["topology.num_targets=1", "topology.num_drafters=2", "train.max_steps=6", "train.save_every=3"]


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(run.run_dir / "drafter" / "model.safetensors"))


@pytest.mark.extended  # seven launches: the longest job test; test_sharding.py covers the steps in-process
def test_a_sharded_run_resumes_bitwise_and_from_an_unsharded_checkpoint(tmp_path, run_cache):
    full = [*COMMON, "drafter.shard=full"]
    straight = launch(tmp_path / "straight", full, run_cache)
    assert straight.returncode == 0, straight.output[-3000:]
    stopped = launch(tmp_path / "stopped", [*full, "train.stop_after_steps=3"], run_cache, torchrun=True)
    assert stopped.returncode == 0, stopped.output[-3000:]
    step3 = tmp_path / "stopped" / "checkpoints" / "step_00000003"
    listed = json.loads((step3 / "COMPLETE").read_text())
    assert listed["format"] == 2 and not (step3 / "model.safetensors").exists(), sorted(listed["files"])
    assert {"state/.metadata", "state/__0_0.distcp", "state/__1_0.distcp"} <= listed["files"].keys()
    resumed = launch(tmp_path / "stopped", full, run_cache, torchrun=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed_step(resumed.rank_log(1)) == 3, resumed.rank_log(1)[-2000:]
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(straight.run_dir) == losses(resumed.run_dir) and straight.ledger() == resumed.ledger()

    # the 2 drafters' shards on one drafter (the same packets per step), and refused on 3
    one = [
        *COMMON[:1],
        "topology.num_drafters=1",
        "optim.grad_accum_steps=2",
        *COMMON[2:],
        f"train.resume={step3}",
    ]
    onto_one = launch(tmp_path / "one", one, run_cache, nproc=2)
    assert onto_one.returncode == 0, onto_one.output[-3000:]
    assert resumed_step(onto_one.rank_log(1)) == 3, onto_one.rank_log(1)[-2000:]
    assert onto_one.ledger() == straight.ledger()[3:]
    d = _weights(onto_one)
    one_worst = max((a[k] - d[k]).abs().max().item() for k in a)
    assert one_worst <= 1e-5, one_worst  # the whole-gradient norm is summed in another order
    three = [
        *COMMON[:1],
        "topology.num_drafters=3",
        *COMMON[2:],
        "drafter.shard=full",
        f"train.resume={step3}",
    ]
    refused = launch(tmp_path / "three", three, run_cache, nproc=4)
    assert refused.returncode == 2, refused.output[-3000:]
    out = refused.output
    assert "topology.packets_per_step: saved=2 current=3" in out and "optim.grad_accum_steps=2" in out, out[
        -3000:
    ]

    unsharded = launch(
        tmp_path / "cross", [*COMMON, "drafter.shard=none", "train.stop_after_steps=3"], run_cache
    )
    crossed = launch(tmp_path / "cross", full, run_cache)
    assert unsharded.returncode == 0 and crossed.returncode == 0, crossed.output[-3000:]
    assert resumed_step(crossed.rank_log(1)) == 3
    c = _weights(crossed)
    worst = max((a[k] - c[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    figure(
        "drafter.shard=full through the job (2 drafters)",
        resumed_bitwise=True,
        resumed_on_one_drafter_max_abs_diff=one_worst,
        unsharded_checkpoint_resumed_sharded_max_abs_diff=worst,
    )


def test_sharding_one_drafter_says_it_has_nothing_to_shard(tmp_path, run_cache):
    run = launch(
        tmp_path / "one",
        ["topology.num_targets=1", "train.max_steps=2", "drafter.shard=full", "logging.mode=disabled"],
        run_cache,
        nproc=2,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert "drafter.shard=full with one drafter: nothing to shard" in run.rank_log(1), run.rank_log(1)[-2000:]
