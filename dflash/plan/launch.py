"""The launch command the planner prints: the config it planned, with the split it recommends.

The command is the user's own command-line overrides (``experiment=``, ``data.token_budget=``,
``drafter.shard=``, ...) as the planner received them, less ``plan.*`` (only the planner reads them),
the topology fields the split sets and the fields the planner chose (:mod:`dflash.plan.search`),
followed by those: composed by ``dflash.train``, it gives the planned config with the recommended split. Every argument is shell-quoted, so the line
pastes as printed.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from dflash.config import TopologyConfig
from dflash.plan.throughput import Split

SPLIT_FIELDS = ("mode", "num_targets", "target_tp", "num_drafters", "drafter_nodes")
"""The ``topology.*`` fields a split sets (any the user gave are replaced)."""


def override_key(arg: str) -> str:
    """The dotted key of a command-line override (``++data.x=1`` -> ``data.x``, ``topology=gpu_1x7`` ->
    ``topology``)."""
    return arg.lstrip("+~").split("=", 1)[0]


def split_overrides(split: Split, topology: TopologyConfig) -> list[str]:
    """The ``topology.*`` overrides that run ``split`` on top of ``topology`` (the planned config's):
    the counts always, the mode, ``target_tp`` and ``drafter_nodes`` when they change."""
    colocated = split.mode == "colocated"
    tp = 1 if colocated else split.target_tp
    want: dict[str, str | int | None] = {
        "mode": "colocated" if colocated else "split",
        "num_targets": 0 if colocated else split.num_targets,
        "target_tp": tp,
        "num_drafters": None if colocated else split.num_drafters,
        "drafter_nodes": None,
    }
    always = ("num_targets", "num_drafters")
    return [
        f"topology.{key}={'null' if want[key] is None else want[key]}"
        for key in SPLIT_FIELDS
        if key in always or want[key] != getattr(topology, key) or (key == "target_tp" and tp > 1)
    ]


def launch_command(
    split: Split,
    topology: TopologyConfig,
    overrides: Sequence[str],
    world_size: int,
    gpus_per_node: int,
    changes: Sequence[str] = (),
) -> str:
    """``torchrun ... -m dflash.train <the user's overrides> <changes> <the split's>``, shell-quoted;
    ``changes``: the planner's own overrides (``data.token_budget=...``: :mod:`dflash.plan.search`),
    which replace the user's of the same key."""
    nodes = -(-world_size // gpus_per_node)
    launch = ["--nnodes", str(nodes), "--nproc_per_node", str(gpus_per_node)] if nodes > 1 else []
    launch = launch or ["--nproc_per_node", str(world_size)]
    replaced = {f"topology.{key}" for key in SPLIT_FIELDS} | {override_key(c) for c in changes}
    kept = [
        a for a in overrides if not override_key(a).startswith("plan.") and override_key(a) not in replaced
    ]
    args = ["torchrun", *launch, "-m", "dflash.train", *kept, *changes, *split_overrides(split, topology)]
    return " ".join(shell_quote(a) for a in args)


def shell_quote(arg: str) -> str:
    """``arg`` for a POSIX shell: as it is when safe, in double quotes when it holds single quotes
    (a Hydra-quoted value: ``"data.path='/my data/x.jsonl'"``) and nothing a shell expands there,
    else ``shlex.quote``'s single quotes."""
    quoted = shlex.quote(arg)
    if quoted == arg or "'" not in arg or any(c in arg for c in '"$`\\!'):
        return quoted
    return f'"{arg}"'
