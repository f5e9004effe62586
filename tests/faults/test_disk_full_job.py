"""A training job whose dataset cache is on a full disk (issue 32, item 5): the ranks stop with one
``dflash: error:`` line (printed by each rank that met the full disk), exit 2, nothing partial left. Real torchrun, 2 ranks in fresh interpreters, started
under a file size limit (``RLIMIT_FSIZE``, inherited by torchrun's workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from runner import env_for, torchrun_cmd

from dflash.config import EXIT_USER_ERROR

pytestmark = pytest.mark.faults

LIMITED = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
os.execv(sys.argv[2], sys.argv[2:])
"""


def test_dataset_cache_on_a_full_disk_stops_the_job_in_one_line(tmp_path, run_cache):
    src = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x = 1\n" * 40}]}
        for i in range(400)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_cache = tmp_path / "data_cache"
    overrides = [
        "topology.num_targets=1",
        f"data.path={src}",
        f"data.cache_dir={data_cache}",
        "logging=disabled",
    ]
    cmd = torchrun_cmd(tmp_path / "run", overrides, nproc=2)
    env = env_for(run_cache)
    env.pop("DFLASH_RANK_SERVER", None)  # rank_exit.py starts `python -m dflash.train`
    env["DFLASH_RANK_EXIT_DIR"] = str(tmp_path / "exits")  # how each rank ended
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED, str(64 << 10), *cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("dflash: error:")]
    # each rank that met the full disk says so (the builder, and a waiting rank that tried again
    # before torchrun stopped it): the same line
    assert len(errors) >= 1 and len(set(errors)) == 1, out[-4000:]  # was: a SafetensorError traceback
    assert f"writing {data_cache}/" in errors[0] and "data.cache_dir=<dir>" in errors[0]
    # torchrun's own ChildFailedError report is its traceback; none comes from dflash's code
    frames = [ln for ln in out.splitlines() if ln.strip().startswith("File ") and "/dflash/" in ln]
    assert frames == [] and "SafetensorError" not in out, out[-4000:]
    assert proc.returncode != 0
    exits = [json.loads(p.read_text())["returncode"] for p in (tmp_path / "exits").glob("*.json")]
    # the first rank to stop exits 2; torchrun may SIGTERM the other before it gets there
    assert len(exits) == 2 and EXIT_USER_ERROR in exits and set(exits) <= {EXIT_USER_ERROR, -signal.SIGTERM}
    assert sorted(p.name for p in data_cache.iterdir() if not p.name.endswith(".lock")) == []
    assert os.path.isdir(tmp_path / "run")
