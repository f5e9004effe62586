"""Count the host syncs of a block of code: the ops after which the host waits for the device.

``HostSyncs`` is a dispatch mode that records every op that makes the host wait for an accelerator
tensor (any device but the CPU), with the first Python frame outside torch that issued it:

- a scalar read (``_local_scalar_dense``, ``item``, ``is_nonzero`` (``bool(t)``), ``equal``);
- an op whose output size depends on the tensor's values (``nonzero``, ``masked_select``,
  ``unique``, indexing with a bool mask, ``repeat_interleave`` without ``output_size``);
- a device-to-host copy, and a blocking host-to-device copy (CUDA synchronises the stream for it).

On a CPU-only machine the ``meta`` device stands for the accelerator: meta tensors hold no data, so
a counted scalar read returns ``scalar`` and a device-to-host copy returns ``fill(shape, dtype)``
(ones by default), and the code goes on as if the values had been read.

    with HostSyncs() as syncs:
        maker.make(g)
    assert len(syncs.where("dflash/")) <= 1, syncs.events
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SCALAR_READS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
VALUE_SHAPED = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
MASK_INDEXED = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


@dataclass
class Sync:
    kind: str
    """scalar read, value-shaped, device-to-host copy or blocking host-to-device copy"""
    op: str
    where: str
    """``path:line function`` of the first frame outside torch and this file"""

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}"


def _on_device(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = str(Path(frame.filename).resolve())
        if path != _HERE and not path.startswith(_TORCH):
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """Records each host sync in ``events`` (see the module docstring)."""

    def __init__(
        self,
        fill: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        scalar: bool | int | float = True,
    ) -> None:
        super().__init__()
        self.events: list[Sync] = []
        self.fill = fill or (lambda shape, dtype: torch.ones(shape, dtype=dtype))
        self.scalar = scalar

    def where(self, fragment: str) -> list[Sync]:
        """The syncs issued from a file whose path contains ``fragment``."""
        return [e for e in self.events if fragment in e.where]

    def _record(self, kind: str, func: object) -> None:
        self.events.append(Sync(kind, str(func).removeprefix("aten."), _caller()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(_on_device(t) for t in tensors)
        if func in SCALAR_READS and on_device:
            self._record("scalar read", func)
            if any(t.device.type == "meta" for t in tensors):
                return self.scalar
        elif func in VALUE_SHAPED and on_device:
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                self._record("value-shaped", func)
        elif func in MASK_INDEXED:
            indices = args[1] if len(args) > 1 else []
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) and _on_device(i) for i in indices):
                self._record("value-shaped", f"{func} with a bool mask")
        elif func is aten._to_copy.default:
            return self._to_copy(func, args, kwargs)
        elif func is aten.copy_.default:
            return self._copy(func, args, kwargs)
        return func(*args, **kwargs)

    def _to_copy(self, func, args, kwargs):
        src = args[0]
        dst = torch.device(kwargs["device"]) if kwargs.get("device") is not None else src.device
        if src.device.type != "cpu" and dst.type == "cpu":
            self._record("device-to-host copy", func)
            if src.device.type == "meta":
                return self.fill(tuple(src.shape), kwargs.get("dtype") or src.dtype)
        elif src.device.type == "cpu" and dst.type != "cpu" and not kwargs.get("non_blocking", False):
            self._record("blocking host-to-device copy", func)
        return func(*args, **kwargs)

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if src.device.type != "cpu" and dst.device.type == "cpu":
            self._record("device-to-host copy", func)
            if src.device.type == "meta":
                return dst.copy_(self.fill(tuple(src.shape), dst.dtype))
        elif src.device.type == "cpu" and dst.device.type != "cpu" and not non_blocking:
            self._record("blocking host-to-device copy", func)
        return func(*args, **kwargs)
