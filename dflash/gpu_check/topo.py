"""Which two GPUs part split runs on: the pair farthest apart in ``nvidia-smi topo -m`` (across NUMA
nodes before across PCIe host bridges before behind one switch before NVLink), so that its packet
times are the slowest link of the host, not the best one."""

from __future__ import annotations

import os
import re
import subprocess

LINK_DISTANCE = {"SYS": 5, "NODE": 4, "PHB": 3, "PXB": 2, "PIX": 1}
"""``nvidia-smi topo -m``'s PCIe paths, farther first (its legend); ``NV#`` (# bonded NVLinks) is nearest."""
LINK_WORDS = {
    "SYS": "across NUMA nodes (PCIe + the CPUs' interconnect)",
    "NODE": "across PCIe host bridges of one NUMA node",
    "PHB": "through a PCIe host bridge",
    "PXB": "through several PCIe switches",
    "PIX": "behind one PCIe switch",
}


def _distance(cell: str) -> float:
    """How far a ``topo -m`` cell puts two GPUs: PCIe paths by the legend's order, NVLink nearer
    than any of them (more bonded links nearer)."""
    if cell in LINK_DISTANCE:
        return LINK_DISTANCE[cell]
    m = re.fullmatch(r"NV(\d+)", cell)
    return -int(m.group(1)) / 1000 if m else 0.0


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """``(i, j) -> cell`` for every pair of GPUs ``i < j`` of ``nvidia-smi topo -m``'s matrix (GPU
    indices as nvidia-smi numbers them; NIC rows and columns and the affinity columns left out)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln.split() for ln in lines if ln.split()[:1] == ["GPU0"]), None)
    if header is None:
        return {}
    columns = [c for c in header if re.fullmatch(r"(GPU|NIC)\d+", c)]
    cells: dict[tuple[int, int], str] = {}
    for ln in lines:
        words = ln.split()
        m = re.fullmatch(r"GPU(\d+)", words[0]) if words else None
        if m is None or len(words) <= len(columns):
            continue
        i = int(m.group(1))
        for col, cell in zip(columns, words[1 : 1 + len(columns)], strict=True):
            g = re.fullmatch(r"GPU(\d+)", col)
            if g and i < int(g.group(1)):
                cells[(i, int(g.group(1)))] = cell
    return cells


def farthest_pair(count: int, visible: str | None, topology: str | None) -> tuple[tuple[str, str], str]:
    """The two GPUs part split runs on, as ``CUDA_VISIBLE_DEVICES`` entries, and why: among the
    ``count`` GPUs torch sees (``visible``: the user's ``CUDA_VISIBLE_DEVICES``, if set), the pair
    ``topology`` (``nvidia-smi topo -m``) puts farthest apart; ties (e.g. every pair on NVSwitch)
    go to the first and last GPU."""
    ids = [v.strip() for v in visible.split(",") if v.strip()][:count] if visible else []
    ids = ids or [str(i) for i in range(count)]
    first_last = (ids[0], ids[-1])
    if not all(i.isdigit() for i in ids):
        return first_last, "the first and last of CUDA_VISIBLE_DEVICES (not indices: no topology read)"
    cells = parse_topology(topology or "")
    gpus = [int(i) for i in ids]
    pairs = [(a, b) for n, a in enumerate(gpus) for b in gpus[n + 1 :]]
    known = {p: cells.get((min(p), max(p)), "") for p in pairs}
    if not all(known.values()):
        return first_last, "the first and last GPU (nvidia-smi topo -m unreadable)"
    far = max(_distance(c) for c in known.values())
    best = [p for p in pairs if _distance(known[p]) == far]
    pick = (gpus[0], gpus[-1]) if (gpus[0], gpus[-1]) in best else best[0]
    cell = known[pick]
    words = LINK_WORDS.get(cell, f"NVLink x{cell[2:]}" if cell.startswith("NV") else cell)
    why = f"{cell}, {words}: " + ("every pair alike" if len(best) == len(pairs) else "the farthest pair")
    return (str(pick[0]), str(pick[1])), why


def read_topology() -> str | None:
    """``nvidia-smi topo -m``'s output, or None when it does not run (10 s at most)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10, env=dict(os.environ)
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None
