"""torchrun entrypoint of tests/runner.py: run the rank, and record how it ended.

The rank is ``python -m dflash.train <args>`` in a fresh interpreter or, when ``$DFLASH_RANK_SERVER``
names tests/ranks.py's rank server, a fork of the session's preloaded forkserver that calls the same
entry point (``runner:job_rank``) with this process's environment (the one torchrun gives a worker),
working directory, stdin, stdout and stderr.

torchrun reports the exit code of the first workers it sees fail, but not of the workers it shuts
down itself (after another rank failed, or after torchrun got SIGTERM). With ``$DFLASH_RANK_EXIT_DIR``
this wrapper records, for every rank and attempt,
``$DFLASH_RANK_EXIT_DIR/rank{RANK}.attempt{TORCHELASTIC_RESTART_COUNT}.json``
= ``{"rank", "attempt", "returncode", "start", "end", "signals"}`` (``returncode`` < 0: killed by that
signal; times are ``time.time()``; ``signals``: what the wrapper received, with times). It ends
the way the child did (same code, or the same signal), so torchrun sees what it would have seen.

SIGTERM/SIGINT/SIGHUP are forwarded to the child, unless ``DFLASH_RANK_EXIT_FORWARD=0``: then the child is
left to end on its own (to check that every rank rejects a bad config by itself, without torchrun
cutting the slower ranks short). The child gets SIGKILL when this process dies (PR_SET_PDEATHSIG for
a fresh interpreter; the rank server's handler for a fork), so torchrun's SIGKILL leaves no process
behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ranks import RANK_SERVER_ENV, ServedRank, die_with_parent


def main() -> None:
    out_dir = os.environ.get("DFLASH_RANK_EXIT_DIR")
    forward = os.environ.get("DFLASH_RANK_EXIT_FORWARD", "1") != "0"
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    received: list[tuple[int, float]] = []
    start = time.time()
    server = os.environ.get(RANK_SERVER_ENV)
    child: ServedRank | subprocess.Popen
    if server:
        child = ServedRank(server, "runner:job_rank", [sys.argv[1:]])
    else:  # a session of its own: torchrun signals this wrapper's whole process group, the child only via on_signal
        child = subprocess.Popen(
            [sys.executable, "-m", "dflash.train", *sys.argv[1:]],
            preexec_fn=die_with_parent,
            start_new_session=True,
        )

    def on_signal(signum: int, frame: object) -> None:
        received.append((signum, time.time()))
        if forward:
            child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    rc = child.wait()
    if out_dir:
        record = {
            "rank": rank,
            "attempt": attempt,
            "returncode": rc,
            "start": start,
            "end": time.time(),
            "signals": received,
        }
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"rank{rank}.attempt{attempt}.json").write_text(json.dumps(record))
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


if __name__ == "__main__":
    main()
