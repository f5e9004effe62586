"""What a config costs: the FLOPs and bytes of one packet per role, the memory per GPU per role, the
packets a run's data makes, and the memory levers that fit a device. Pure models, read by the planner
(:mod:`dflash.plan`, which adds the GPU's figures and the search) and by training (its memory
levers and its ``perf/tflops/*``), neither of which they import.

``costs.py``    FLOPs and wire bytes of one packet per role (formulas in its docstring)
``memory.py``   memory per GPU per role, GiB by item
``packets.py``  the packets one epoch of the data plan makes, and the anchors they offer and keep
``inputs.py``   what a config implies: the target's shape, the drafter, the data statistics, the packets
``fit.py``      the memory levers that fit a capacity (block chunks, checkpointing, anchor caps)
"""

from dflash.sizing.costs import AttentionKind, PacketCosts, PacketShape, packet_costs
from dflash.sizing.memory import RunDtypes, memory_per_role

__all__ = [
    "AttentionKind",
    "PacketCosts",
    "PacketShape",
    "RunDtypes",
    "memory_per_role",
    "packet_costs",
]
