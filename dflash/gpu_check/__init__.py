"""The GPU readiness check (``make gpu-check``, ``python scripts/gpu_check.py``; how to run it and its
parts kernels, loss, colocated, split and tp: ``cli.py``'s docstring, the ``--help`` text).

The check runs from a checkout, not from an installed package: part kernels runs the repository's
``tests/gpu``, part loss its ``scripts/bench_loss.py``, and every subprocess starts in the repository root
(``profiles.REPO``) with it on ``PYTHONPATH``.

``profiles.py`` the sizes and time budgets of a GPU run and of the CPU dry run, the training parts' launches
``procs.py``    subprocesses with a time budget; on timeout their whole process tree is killed
``inputs.py``   the random-weights target directory and the chat data of the training parts
``planner.py``  the run's config and the planner's FLOP, MFU and memory on it
``probe.py``    the target's headless forward on one packet: memory, largest tensor, logits made
``figures.py``  figures from pytest's output, bench_loss.py's JSON lines and a run's metrics.jsonl
``targets.py``  the judged "good" figures
``check.py``    the orchestrator: device, budgets, one method per part, the JSON summary
``table.py``    the header and the table
``cli.py``      ``main()``: the command line
"""
