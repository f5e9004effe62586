"""R7: a user's mistake is rejected on every rank before any process group or model, printed once,
short, without a traceback, and every rank exits 2.

Launches of 3 ranks for the cases that differ in where they are caught: a typo Hydra rejects, a key
the schema does not know, a cross-field config error, a world-size mismatch, a tap id only the
target's config.json shows, a target path that does not exist. The ranks are left to fail on their
own (no SIGTERM after the first failure), so every rank's own rejection is checked, and their own
output (stdout and stderr of every rank) is what is counted. The typo runs under real torchrun
(workers' output captured per rank with ``--redirects 3 --log-dir``; torchrun's failure report about
the failed workers is not ours and is left out of the count; tests/rank_exit.py does not forward
torchrun's SIGTERM), each rank a fresh ``python -m dflash.train``: a command line parsed as torchrun
passes it to a new interpreter. The others are in-process launches (tests/runner.py). Every other
misconfiguration goes through the same entry point in-process (``dflash.train.job.train`` as rank 0
of a 3-rank world), which is where the launches above spend their time anyway.
"""

from __future__ import annotations

import pytest
from faultkit import figure
from runner import FAST, launch, no_leftover_processes

from dflash.cli import compose_config
from dflash.config import EXIT_USER_ERROR, UserError, register_configs

pytestmark = pytest.mark.faults

LAUNCHED = [
    (
        "typo without +",
        ["train.max_step=5"],
        "unknown config key(s): train.max_step (did you mean train.max_steps?)",
    ),
    ("unknown +key", ["+train.max_step=5"], "train.max_step (did you mean train.max_steps?)"),
    (
        "eval without held-out data",
        ["eval.every=10", "data.num_eval_prompts=0"],
        "data.num_eval_prompts=0 holds out no",
    ),
    ("world size mismatch", ["topology.num_targets=3"], "= 4 ranks but the launch has WORLD_SIZE=3"),
    (
        "tap id out of range",
        ["target.layer_ids=[1,2,9]"],
        "target.layer_ids=[1, 2, 9]: layers [9] outside the target's 6",
    ),
    (
        "missing target dir",
        ["target.tiny=null", "target.path=/models/Qwen3-8B"],
        "target.path=/models/Qwen3-8B: no such directory; give a local directory with config.json",
    ),
]


TORCHRUN_CASE = "typo without +"


@pytest.mark.parametrize(("case", "overrides", "needle"), LAUNCHED, ids=[c[0] for c in LAUNCHED])
def test_mistake_is_printed_once_short_before_anything_starts(tmp_path, run_cache, case, overrides, needle):
    logs = tmp_path / "workers"
    run_dir = tmp_path / "run"
    as_user = {"HYDRA_FULL_ERROR": "0"}  # as a user runs it (the test runner asks Hydra for tracebacks)
    if case == TORCHRUN_CASE:
        run = launch(
            run_dir,
            overrides,
            run_cache,
            nproc=3,
            torchrun=True,
            rdzv=["--standalone", "--redirects=3", f"--log-dir={logs}"],
            record_exits=True,
            forward_signals=False,
            fresh_interpreters=True,
            timeout=90,
            env=as_user,
        )
        printed = "".join(p.read_text() for p in sorted(logs.rglob("std*.log")))
    else:
        run = launch(
            run_dir, overrides, run_cache, nproc=3, stop_peers_on_failure=False, timeout=90, env=as_user
        )
        printed = "".join(run.rank_output(r) for r in range(3))
    assert run.returncode != 0
    lines = [ln for ln in printed.splitlines() if ln.strip()]
    assert printed.count(needle) == 1, printed[-3000:]
    assert len(lines) < 15 and "Traceback" not in printed, printed
    exits = run.exits()
    assert [exits[(r, 0)]["returncode"] for r in range(3)] == [EXIT_USER_ERROR] * 3, exits
    for r in range(3):
        log = run.rank_log(r)
        if case != "typo without +":  # Hydra rejects the command line before any log file exists
            assert "stopped:" in log and needle in log, log[-2000:]
        # rejected before init_distributed: no process group, no target or drafter model
        assert "gloo on" not in log and "loaded target" not in log and "Traceback" not in log
    ended = max(e["end"] for e in exits.values()) - run.started_at
    assert ended <= 30
    figure(
        f"R7 {case}",
        lines_printed=len(lines),
        exit_codes=[EXIT_USER_ERROR] * 3,
        all_ranks_done_s=round(ended, 1),
    )
    assert no_leftover_processes(run)


IN_PROCESS = [
    (
        "mask token outside the vocab",
        ["drafter.mask_token_id=5000"],
        "mask token id 5000 from drafter.mask_token_id is outside the target vocabulary [0, 2112)",
    ),
    (
        "hidden size mismatch",
        ["drafter.hidden_size=64"],
        "drafter.hidden_size=64 differs from the target's hidden_size=128",
    ),
    ("negative layer id", ["target.layer_ids=[-1,2,4]"], "target.layer_ids=[-1, 2, 4] has a negative id"),
    ("empty layer ids", ["target.layer_ids=[]"], "target.layer_ids=[] is empty"),
    ("max_length <= 0", ["data.max_length=0"], "data.max_length=0: must be >= 2"),
    ("save_every < 1", ["train.save_every=0"], "train.save_every=0: must be >= 1"),
    ("keep_checkpoints < 2", ["train.keep_checkpoints=1"], "train.keep_checkpoints=1: keep at least 2"),
    (
        "trust_remote_code without a revision",
        ["target.trust_remote_code=true"],
        "target.trust_remote_code=true needs target.revision=<40-hex commit hash>",
    ),
    ("duplicate layer ids", ["target.layer_ids=[1,1,4]"], "target.layer_ids=[1, 1, 4] has duplicates"),
    ("token_budget < max_length", ["data.token_budget=100"], "data.token_budget=100 < data.max_length=160"),
    (
        "muon momentum >= 1",
        ["optim=muon", "optim.muon_momentum=1.5"],
        "optim.muon_momentum=1.5: must be in [0, 1)",
    ),
]


@pytest.mark.parametrize(("case", "overrides", "needle"), IN_PROCESS, ids=[c[0] for c in IN_PROCESS])
def test_mistake_is_a_user_error_of_the_entry_point(
    tmp_path, run_cache, monkeypatch, case, overrides, needle
):
    from dflash.train.job import train

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(run_cache))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    register_configs()
    dcfg = compose_config("config", [*FAST, *overrides])
    with pytest.raises(UserError) as err:
        train(dcfg, tmp_path / "run")
    assert needle in str(err.value) and err.value.scope == "all"
    assert not (tmp_path / "run" / "checkpoints").exists()
