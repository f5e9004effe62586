"""CPU workspace of the chunked verifier loss, kept between calls.

:func:`~dflash.loss.verifier.verifier_loss` puts its ``[C, V]`` chunk buffers and ``[S, V]``
scratch in one flat buffer (GBs at a 150K-250K vocabulary). First touch of a fresh multi-GB CPU
buffer costs a page fault per page (a large share of a call at these sizes, even with huge
pages), so on CPU the largest workspace per ``(device, dtype)`` is kept for the next call, as the CUDA caching allocator does on GPUs:
:func:`acquire_workspace` takes it (or allocates a fresh one), :func:`return_workspace` puts it
back and :func:`release_workspace` frees it. On Linux a fresh CPU buffer is backed by transparent
huge pages when possible (``madvise(MADV_HUGEPAGE)``). Thread-safe: a concurrent call finds the
cache empty and allocates its own.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import Tensor

from dflash.loss.device import kernel_device

__all__ = ["acquire_workspace", "release_workspace", "return_workspace"]

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc_madvise: Any = None
"""libc's madvise once looked up; False where there is none (then huge pages are never asked for)."""


def _madvise_huge(ptr: int, nbytes: int) -> bool:
    global _libc_madvise
    if _libc_madvise is False:
        return False
    try:
        if _libc_madvise is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _libc_madvise = fn
        return _libc_madvise(ptr, nbytes, _MADV_HUGEPAGE) == 0
    except Exception:  # pragma: no cover - not Linux / no libc
        _libc_madvise = False
        return False


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat uninitialised buffer; on Linux CPU backed by transparent huge pages when possible.

    A fresh CPU buffer takes one page fault per 4 KiB page on first touch; with ``MADV_HUGEPAGE``
    (honoured when THP is ``madvise`` or ``always``) one per 2 MiB page, and the elementwise passes
    see fewer TLB misses.
    """
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * item
    if (
        kernel_device(device) != "cpu"
        or nbytes < 8 * _HUGE_PAGE
        or _libc_madvise is False
        or not sys.platform.startswith("linux")
    ):
        return torch.empty(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _HUGE_PAGE
    _madvise_huge(raw.data_ptr() + off, nbytes - nbytes % _HUGE_PAGE)
    return raw[off : off + nbytes].view(dtype)


_WS_LOCK = threading.Lock()
_WS_CACHE: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def acquire_workspace(numel: int, dtype: torch.dtype, device: torch.device, keep: bool) -> Tensor:
    """A flat workspace of at least ``numel`` elements: on CPU the one kept from an earlier call
    when it is large enough.

    First touch of a fresh multi-GB CPU buffer costs a page fault per page, so on CPU the
    workspace is kept between calls, as the CUDA caching allocator does on GPUs. A
    concurrent call finds the cache empty and allocates its own.
    """
    if keep and kernel_device(device) == "cpu":
        with _WS_LOCK:
            ws = _WS_CACHE.pop((device, dtype), None)
        if ws is not None and ws.numel() >= numel:
            return ws
        del ws  # too small: free it before allocating the larger one
    return _workspace(numel, dtype, device)


def return_workspace(ws: Tensor, keep: bool) -> None:
    """Keep ``ws`` for the next call (CPU, ``keep``) unless a larger one is already kept."""
    if keep and kernel_device(ws.device) == "cpu":
        key = (ws.device, ws.dtype)
        with _WS_LOCK:
            cur = _WS_CACHE.get(key)
            if cur is None or cur.numel() < ws.numel():
                _WS_CACHE[key] = ws


def release_workspace() -> None:
    """Free the CPU workspace that :func:`~dflash.loss.verifier.verifier_loss` keeps between calls."""
    with _WS_LOCK:
        _WS_CACHE.clear()
