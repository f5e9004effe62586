"""Messages that misled (issue 19, item 12): a tokenizer without a chat template, a full disk under
an append, ``dflash.report`` on damaged metrics, the multi-node launcher's thread default."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO
from transformers import AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.tokenize import MissingChatTemplate
from dflash.files import append_line


def test_a_tokenizer_without_chat_template_is_one_config_error_not_malformed_records(
    tiny_target_dir, tmp_path
):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.chat_template = None
    src = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(5)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MissingChatTemplate) as err:  # was: 5 of 5 "malformed", fix the records
        build_or_load_dataset(cfg, tok, len(tok))
    msg = str(err.value)
    assert "has no chat template" in msg and f"(first: {src}:1)" in msg and "set target.tokenizer=" in msg
    assert "malformed" not in msg and not list((tmp_path / "cache").glob("*/meta.json"))
    # records that carry their own ids need no template
    src.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}) + "\n")
    assert len(build_or_load_dataset(cfg, tok, len(tok))) == 1


APPEND_UNDER_LIMIT = r"""
import resource, signal, sys
from dflash.files import append_line
path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    append_line(path, "x" * 200)
except OSError as e:
    print(e)
"""


def test_a_write_the_disk_cannot_take_leaves_no_torn_line_and_names_the_cause(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_line(path, json.dumps({"train/step": 1}))
    before = path.read_bytes()
    # a file size limit 50 bytes past the end: the kernel takes part of the line (a short write), as
    # a disk that fills up mid-write does
    limit = len(before) + 50
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", APPEND_UNDER_LIMIT, str(path), str(limit)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert path.read_bytes() == before  # the whole line or nothing: no torn line left
    assert f"appending to {path} failed after 50 of 201 bytes: file too large" in proc.stdout
    assert "the partial line was removed" in proc.stdout
    # a full disk: /dev/full answers every write with ENOSPC
    with pytest.raises(OSError) as err:
        append_line("/dev/full", "x")
    assert "no space left on device: free disk space" in str(err.value)  # was: "EIO short write"


def _report(run_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "dflash.report", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


def test_report_leaves_out_bad_rows_and_names_them(tmp_path):
    rows = [json.dumps({"train/step": s, "train/loss": 5.0 - s / 10}) for s in range(1, 61)]
    rows[9] = '{"train/step": 10, "train/lo'  # a damaged middle line, newline kept
    rows[20] = json.dumps({"train/step": math.nan, "train/loss": 1.0})  # NaN step (json writes NaN)
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + '{"train/step": 61')  # torn tail
    proc = _report(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # was: exit 1 printing nothing (NaN step)
    out = proc.stdout
    assert "left out 2: damaged line 10; a row with train/step=nan" in out
    assert "58 logged steps, last step 60" in out  # was: stopped silently at line 10 (9 steps)
    assert (tmp_path / "report.html").is_file()


def test_the_multinode_launcher_gives_each_process_its_share_of_the_cores(tmp_path):
    """OMP_NUM_THREADS defaulted to 8 per process whatever the host: on 8 processes of a 16-core
    host, 64 threads on 16 cores (6 steps took 4 minutes instead of 37 s). The launcher's own
    torchrun is replaced by a script that prints what it was given."""
    fake = tmp_path / "bin" / "torchrun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "OMP_NUM_THREADS=$OMP_NUM_THREADS $*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {
        **{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "NNODES": "2",
        "NODE_RANK": "0",
        "ENDPOINT": "node0:29500",
        "RUN_DIR": str(tmp_path / "run"),
    }
    script = REPO / "scripts" / "launch_multinode.sh"
    cores = len(os.sched_getaffinity(0))
    for nproc, want in (("1", cores), (str(cores * 4), 1)):
        out = subprocess.run(
            [str(script), "x=1"], env={**env, "NPROC": nproc}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"OMP_NUM_THREADS={want} ") and f"--nproc-per-node {nproc}" in out.stdout
    out = subprocess.run([str(script)], env={**env, "OMP_NUM_THREADS": "3"}, capture_output=True, text=True)
    assert out.stdout.startswith("OMP_NUM_THREADS=3 ")  # an explicit setting wins
