"""R7: bad configs are rejected on every rank before any model loads (before the process group even
exists), within 30 s, with a message naming the field (no traceback) and exit code 2. Each case is a real torchrun launch; the
ranks are left to fail on their own (tests/rank_exit.py does not forward torchrun's SIGTERM), so
every rank's own rejection is checked, not only the first one torchrun sees. To fit the CI budget
the world is 1 target + 1 drafter (every role; each rank validates the same way whatever the
world), except for the world-size case, which launches 2 ranks for the default 2 + 1 topology."""

from __future__ import annotations

import pytest
from faultkit import figure
from runner import launch, no_leftover_processes

from dflash.config import EXIT_USER_ERROR

pytestmark = pytest.mark.faults

# (case, overrides, ranks launched, text every rank's log must hold). The tiny target has 6 decoder
# layers, hidden size 128 and 2112 embedding rows; the first three need its config.json/tokenizer.
ONE_TARGET = ["topology.num_targets=1"]
CASES = [
    (
        "tap id out of range",
        [*ONE_TARGET, "target.layer_ids=[1,2,9]"],
        2,
        "target.layer_ids=[1, 2, 9]: layers [9] outside the target's 6 decoder layers",
    ),
    (
        "mask token outside the vocab",
        [*ONE_TARGET, "drafter.mask_token_id=5000"],
        2,
        "mask token id 5000 from drafter.mask_token_id is outside the target vocabulary [0, 2112)",
    ),
    (
        "hidden size mismatch",
        [*ONE_TARGET, "drafter.hidden_size=64"],
        2,
        "drafter.hidden_size=64 differs from the target's hidden_size=128",
    ),
    ("world size mismatch", [], 2, "= 3 ranks but the launch has WORLD_SIZE=2"),
    (
        "negative layer id",
        [*ONE_TARGET, "target.layer_ids=[-1,2,4]"],
        2,
        "target.layer_ids=[-1, 2, 4] has a negative id",
    ),
    ("empty layer ids", [*ONE_TARGET, "target.layer_ids=[]"], 2, "target.layer_ids=[] is empty"),
    ("max_length <= 0", [*ONE_TARGET, "data.max_length=0"], 2, "data.max_length=0: must be >= 2"),
    ("save_every < 1", [*ONE_TARGET, "train.save_every=0"], 2, "train.save_every=0: must be >= 1"),
    (
        "keep_checkpoints < 2",
        [*ONE_TARGET, "train.keep_checkpoints=1"],
        2,
        "train.keep_checkpoints=1: keep at least 2",
    ),
    (
        "trust_remote_code without a revision",
        [*ONE_TARGET, "target.trust_remote_code=true"],
        2,
        "target.trust_remote_code=true needs target.revision=<40-hex commit hash>",
    ),
    (
        "duplicate layer ids",
        [*ONE_TARGET, "target.layer_ids=[1,1,4]"],
        2,
        "target.layer_ids=[1, 1, 4] has duplicates",
    ),
    (
        "unknown logging.mode",
        [*ONE_TARGET, "logging.mode=online_please"],
        2,
        "logging.mode='online_please' is not one of",
    ),
    (
        "token_budget < max_length",
        [*ONE_TARGET, "data.token_budget=100"],
        2,
        "data.token_budget=100 < data.max_length=160",
    ),
]


@pytest.mark.parametrize(("case", "overrides", "nproc", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_config_rejected_on_every_rank_before_any_model_loads(
    tmp_path, run_cache, case, overrides, nproc, needle
):
    run = launch(
        tmp_path / "run",
        overrides,
        run_cache,
        nproc=nproc,
        record_exits=True,
        forward_signals=False,
        timeout=90,
    )
    assert run.returncode != 0
    exits = run.exits()
    assert sorted(exits) == [(r, 0) for r in range(nproc)]
    for r in range(nproc):
        assert exits[(r, 0)]["returncode"] == EXIT_USER_ERROR, run.output[-3000:]
        log = run.rank_log(r)
        assert "stopped:" in log and needle in log and "Traceback" not in log, log[-3000:]
        # rejected before init_distributed: no process group, no target or drafter model
        assert "gloo on" not in log and "loaded target" not in log and "trainable parameters" not in log
    ended = max(e["end"] for e in exits.values()) - run.started_at
    assert ended <= 30
    figure(
        f"R7 {case}",
        ranks_rejecting=nproc,
        exit_codes=[exits[(r, 0)]["returncode"] for r in range(nproc)],
        all_ranks_done_s=round(ended, 1),
        torchrun_s=round(run.seconds, 1),
    )
    assert no_leftover_processes(run.run_dir)
