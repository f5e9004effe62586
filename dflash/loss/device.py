"""Which kernels the drafter step picks for a device, and the switch that makes a CPU run pick CUDA's.

The chunked loss (``verifier.py``, ``kernels.py``, ``workspace.py``) branches on the kind of device
its tensors live on: on CUDA the projections are bf16 GEMMs with fp32 output and the logit gradient
is cast to bf16 for its GEMM, row blocks are 256 rows, the workspace is freed after each call (the
caching allocator keeps it); on CPU the operands are upcast, a base-2 fast path runs and the
workspace is kept. Each branch asks :func:`kernel_device`.

The planner's real-size rehearsal (:mod:`dflash.plan.rehearse`) runs the step on fake CPU tensors and
must take the CUDA branches: inside :func:`as_cuda` :func:`kernel_device` answers ``cuda`` whatever
the tensors' device, and :func:`uncounted` is the scope the rehearsal gives for work whose memory a
GPU run does not have (the flex block mask, built by a compiled kernel on CUDA and eagerly there).
Outside it both are no-ops. What is compiled still follows the tensors' real device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

# A module global, not a ContextVar: torch.compile traces a global read (and guards on it), so the
# compiled loss kernels keep taking the branches of their tensors' device.
_AS_CUDA: list[Callable[[], AbstractContextManager[object]]] = []


def kernel_device(device: torch.device) -> str:
    """The device kind whose kernels run for tensors on ``device``: its type, or ``cuda`` inside :func:`as_cuda`."""
    return "cuda" if _AS_CUDA else device.type


def uncounted() -> AbstractContextManager[object]:
    """The scope whose allocations the rehearsal does not count (a no-op outside :func:`as_cuda`)."""
    return _AS_CUDA[-1]() if _AS_CUDA else nullcontext()


@contextmanager
def as_cuda(uncounted_scope: Callable[[], AbstractContextManager[object]] = nullcontext) -> Iterator[None]:
    """Take the CUDA branches of the drafter step whatever the tensors' device (the rehearsal);
    ``uncounted_scope()`` wraps what :func:`uncounted` marks."""
    _AS_CUDA.append(uncounted_scope)
    try:
        yield
    finally:
        _AS_CUDA.pop()
