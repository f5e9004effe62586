"""The command line of a single-node ``torchrun`` launch (``--standalone``) of a dflash module."""

from __future__ import annotations

import sys


def torchrun_command(nproc: int, args: list[str], module: str = "dflash.train") -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=<nproc> -m <module> <args>``
    with this interpreter: ``nproc`` processes on this host, ``args`` (Hydra overrides) after the module."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]
