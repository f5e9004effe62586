"""Printed commands paste as printed (issue 32, item 9): a run whose directory holds a space, ``=``
and a non-ASCII character (``hydra.run.dir='.../my run=1/ü'``) ends with a summary whose every
command, pasted into a shell, runs on that directory (before: ``python -m dflash.report outputs/my
run=1/ü`` unquoted, and quoted, the path was taken as a Hydra override)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from runner import launch
from testpaths import REPO

COMMAND_STARTS = ("python -m ", "wandb ")


def printed_commands(table: str) -> list[str]:
    """Every command of the summary table: from ``python -m`` or ``wandb`` to the first ``;`` or
    `` (`` outside single quotes, or the end of the line."""
    out = []
    for line in table.splitlines():
        for start in (m.start() for m in re.finditer("|".join(map(re.escape, COMMAND_STARTS)), line)):
            quoted, end = False, len(line)
            for i in range(start, len(line)):
                if line[i] == "'":
                    quoted = not quoted
                elif not quoted and (line[i] == ";" or line.startswith(" (", i)):
                    end = i
                    break
            out.append(line[start:end].strip())
    return out


WANDB_SHIM = """wandb() {  # each path argument must exist: the shell passed it whole
  case "$1" in leet|sync) ;; *) exit 9 ;; esac
  shift; [ $# -eq 1 ] && [ -e "$1" ] || { echo "wandb got $# arguments: $*" >&2; exit 8; }
  echo "wandb ok: $1"
}
"""


def test_every_summary_command_runs_pasted_with_a_hostile_run_dir(tmp_path, run_cache):
    run_dir = tmp_path / "my run=1" / "ü"
    run = launch(run_dir, ["train.max_steps=2", "logging=offline"], run_cache)
    assert run.returncode == 0, run.output[-4000:]
    table = run.stdout[run.stdout.index("dflash run summary") :]
    commands = printed_commands(table)
    assert [shlex.split(c)[:3] for c in commands] == [
        ["python", "-m", "dflash.report"],
        ["wandb", "leet", str(run_dir / "wandb")],
        ["wandb", "sync", f"{run_dir / 'wandb'}/offline-run-*"],
    ], table
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(REPO)
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", WANDB_SHIM + command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert (run_dir / "report.html").is_file()  # the report command wrote its page into that directory
    # the path forms of dflash.report: after --, and key=value with the path Hydra-quoted
    for args in (["--", str(run_dir)], [f"run_dir='{run_dir}'", f"out={tmp_path / 'r.html'}"]):
        proc = subprocess.run(
            [sys.executable, "-m", "dflash.report", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
    assert (tmp_path / "r.html").is_file()
