"""The planner: what one packet costs each role, and how to use a world of GPUs for a config.

``costs.py``      FLOPs and wire bytes of one packet per role (pure Python; formulas in its docstring)
``memory.py``     memory per GPU per role, GiB by item (pure Python)
``throughput.py`` packets/s of every N:M split and of the co-located mode (pure Python)
``inputs.py``     what a config implies: the GPU, the target's shape, the drafter, data statistics, the packet
``planner.py``    the plan of one config; ``tables.py`` its table and JSON; ``app.py`` ``python -m dflash.plan``

The trainer imports the pure part at run time (``perf/tflops/*`` and busy fractions)::

    costs = packet_costs(meta, arch, PacketShape(tokens, num_seqs, num_anchors,
                         loss_rows=...), cfg.loss, target_attention=..., drafter_attention=...)
"""

from dflash.plan.costs import AttentionKind, PacketCosts, PacketShape, packet_costs
from dflash.plan.memory import RunDtypes, memory_per_role

__all__ = [
    "AttentionKind",
    "PacketCosts",
    "PacketShape",
    "RunDtypes",
    "memory_per_role",
    "packet_costs",
]
