"""A user's mistake is printed once, short, before any process group or model, and every rank exits 2.

Each case is a real torchrun launch of 3 ranks whose workers' own output is captured per rank
(``--redirects 3 --log-dir``): torchrun's failure report (its own lines about the failed workers)
is not ours and is left out of the count. Every rank writes the message to its own log.
"""

from __future__ import annotations

import pytest
from faultkit import figure
from runner import launch, no_leftover_processes

from dflash.config import EXIT_USER_ERROR

pytestmark = pytest.mark.faults

CASES = [
    ("unknown +key", ["+train.max_step=5"], "train.max_step (did you mean train.max_steps?)"),
    ("typo without +", ["train.max_step=5"], "Could not override 'train.max_step'"),
    (
        "eval without held-out data",
        ["eval.every=10", "data.num_eval_prompts=0"],
        "data.num_eval_prompts=0 holds out no conversation",
    ),
    (
        "missing target dir",
        ["target.tiny=null", "target.path=/models/Qwen3-8B"],
        "target.path=/models/Qwen3-8B: no such directory; give a local directory with config.json",
    ),
]


@pytest.mark.parametrize(("case", "overrides", "needle"), CASES, ids=[c[0] for c in CASES])
def test_user_error_is_printed_once_and_short(tmp_path, run_cache, case, overrides, needle):
    logs = tmp_path / "workers"
    run_dir = tmp_path / "run"
    rdzv = ["--standalone", "--redirects=3", f"--log-dir={logs}"]
    run = launch(
        run_dir,
        overrides,
        run_cache,
        nproc=3,
        rdzv=rdzv,
        record_exits=True,
        forward_signals=False,
        env={"HYDRA_FULL_ERROR": "0"},  # as a user runs it (the test runner asks Hydra for tracebacks)
    )
    assert run.returncode != 0
    outputs = [p.read_text() for p in sorted(logs.rglob("std*.log"))]
    printed = "".join(outputs)
    lines = [ln for ln in printed.splitlines() if ln.strip()]
    assert printed.count(needle) == 1, printed[-3000:]
    assert len(lines) < 15 and "Traceback" not in printed, printed
    exits = run.exits()
    assert [exits[(r, 0)]["returncode"] for r in range(3)] == [EXIT_USER_ERROR] * 3, exits
    for r in range(3):
        log = run.rank_log(r)
        if case != "typo without +":  # Hydra rejects the command line before any log file exists
            assert "stopped:" in log and needle in log, log[-2000:]
        assert "gloo on" not in log and "loaded target" not in log and "Traceback" not in log
    figure(f"user error: {case}", lines_printed=len(lines), exit_codes=[EXIT_USER_ERROR] * 3)
    assert no_leftover_processes(run_dir)
