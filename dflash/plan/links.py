"""The links between a host's GPUs as the planner prices them (:class:`dflash.config.GpuSpec`).

Three kinds: NVLink (``nvlink_gbps`` > 0, the datasheet's both-directions figure: half of it one way),
PCIe with peer-to-peer access (``pcie_gbps`` one way, GPU to GPU) and PCIe without it (consumer cards
under the stock driver: NCCL stages every transfer through host memory, two copies, so half of
``pcie_gbps``). Packets and tensor-parallel traffic use the one-way figure; the drafters' gradient
all-reduce uses the NCCL bus bandwidth (``allreduce_busbw_gbps``; 0: the one-way figure). Beyond one
host every transfer takes the network share ``internode_gbps``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config import GpuSpec


@dataclass(frozen=True)
class Link:
    kind: str
    """``NVLink``, ``PCIe P2P``, ``PCIe via host memory`` or ``network``."""
    one_way_bytes_per_s: float
    allreduce_bytes_per_s: float
    """NCCL all-reduce bus bandwidth: a ring all-reduce of ``n`` ranks takes ``2*(n-1)/n * bytes`` over it."""


def intranode_link(gpu: GpuSpec) -> Link:
    """The link between two GPUs of one host."""
    if gpu.nvlink_gbps > 0:
        kind, one_way = "NVLink", gpu.nvlink_gbps / 2
    elif gpu.p2p:
        kind, one_way = "PCIe P2P", gpu.pcie_gbps
    else:
        kind, one_way = "PCIe via host memory", gpu.pcie_gbps / 2
    busbw = gpu.allreduce_busbw_gbps or one_way
    return Link(kind, one_way * 1e9, busbw * 1e9)


def link_for(gpu: GpuSpec, world_size: int) -> Link:
    """The link a world of ``world_size`` GPUs moves packets and gradients over: the host's own
    within one host, the network beyond it."""
    if world_size <= gpu.gpus_per_node:
        return intranode_link(gpu)
    net = gpu.internode_gbps * 1e9
    return Link("network", net, net)


def link_problems(gpu: GpuSpec, where: str) -> list[str]:
    """What makes ``gpu`` unusable for the link model, each naming the field and the fix."""
    if gpu.nvlink_gbps > 0 or gpu.pcie_gbps > 0:
        return []
    return [
        f"{where}: neither nvlink_gbps nor pcie_gbps is set; give nvlink_gbps (NVLink, both directions, "
        "datasheet) or pcie_gbps (PCIe, one way GPU to GPU, measured), e.g. plan.gpu_spec.pcie_gbps=25"
    ]
