"""Fake tensors that keep small values real, and a tracker of live tensor bytes: the machinery of the
real-size rehearsal (:mod:`dflash.plan.rehearse`).

:class:`RealSmall` sits on top of torch's ``FakeTensorMode``. A large tensor (hidden states, weights,
logit chunks) is a ``FakeTensor``: shape, dtype and strides, no storage, no FLOPs. An op whose tensor
inputs are all real and whose outputs are index-like (token ids, masks, anchors, row indices, loss
weights: :data:`DEFAULT_MAX_REAL_NUMEL` and :data:`DEFAULT_MAX_REAL_FLOAT_NUMEL`) runs for real, so
data-dependent code (``nonzero``, ``tolist()``, Python branches on values) runs as in training; no GEMM
ever runs for real. Any other op runs on fake tensors. A value computed from a fake
tensor is fake even when small: reading it (``item()``) raises, as it would be a guess. Writing a fake
value into a real tensor leaves the real one unchanged (its values are wrong, its memory is right), and
real integer ``empty`` tensors are zero-filled so that such values stay valid indices.

:class:`LiveBytes` counts the bytes of every storage an op creates until the last reference to it
dies (weak references on storages, as ``torch.distributed._tools.mem_tracker.MemTracker`` does: it
gives the same peak), labelled with the term that was current when it was allocated
(:meth:`LiveBytes.term`), and keeps the event history so that the live tensors at the peak can be
listed afterwards. Nothing is rounded to allocator blocks and nothing outside tensors (CUDA context,
library workspaces, fragmentation) is counted.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

DEFAULT_MAX_REAL_NUMEL = 1 << 21
"""Largest integer or boolean output (elements) an all-real op may have and stay real: above every
index tensor of a packet (tokens, block slots: 10^4 to 10^5) and below its masks' ``[Q, S + Q]``."""
DEFAULT_MAX_REAL_FLOAT_NUMEL = 1 << 18
"""Largest floating output that stays real: the per-slot and per-row loss weights of a packet of up to
16,384 blocks, below the hidden states of any packet worth rehearsing (so no GEMM runs for real)."""

_EMPTY = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_REPO_PREFIX = str(Path(__file__).resolve().parents[2]) + "/"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class RealSmall(TorchDispatchMode):
    """Run all-real ops with small outputs for real, everything else on fake tensors (module doc).

    Enter it inside the ``FakeTensorMode`` it defers to (built with ``allow_non_fake_inputs=True``).
    """

    supports_higher_order_operators = True

    def __init__(
        self,
        fake_mode: FakeTensorMode,
        max_real_numel: int = DEFAULT_MAX_REAL_NUMEL,
        max_real_float_numel: int = DEFAULT_MAX_REAL_FLOAT_NUMEL,
    ) -> None:
        super().__init__()
        if not fake_mode.allow_non_fake_inputs:
            raise ValueError("RealSmall needs a FakeTensorMode(allow_non_fake_inputs=True)")
        self.fake_mode = fake_mode
        self.max_real_numel = max_real_numel
        self.max_real_float_numel = max_real_float_numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _wrapper_subclass(types):
            return NotImplemented
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        # torch's own tracing enters the fake mode again to make fakes (flex_attention's score graphs)
        nested = len(self.fake_mode.enter_stack) > 1
        if nested or isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(isinstance(t, FakeTensor) for t in inputs):
            # a fake op reads no values: a fresh fake stands in for each real input (cheaper than converting it)
            return func(*tree_map(_as_fake, args), **tree_map(_as_fake, kwargs))
        shapes = _meta_outputs(func, args, kwargs)
        if shapes is None or all(self._small(t) for t in shapes):
            return self._real(func, args, kwargs)
        return func(*args, **kwargs)

    def _small(self, t: torch.Tensor) -> bool:
        """Index-like: at most ``max_real_numel`` elements, a floating one at most ``max_real_float_numel``."""
        limit = self.max_real_float_numel if t.is_floating_point() else self.max_real_numel
        return t.numel() <= limit

    @staticmethod
    def _real(func, args, kwargs):
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
            if func in _EMPTY and not out.is_floating_point():
                out.zero_()  # integer empties are indices: keep them valid
        return out


def _wrapper_subclass(types: Any) -> bool:
    """A tensor subclass such as ``DTensor`` (FSDP2's shards) among the op's types: it runs first and
    comes back with its plain (local) tensors, which are what is fake, real and counted."""
    return any(t is not FakeTensor and t is not torch.Tensor and t is not torch.nn.Parameter for t in types)


def _as_fake(x: Any) -> Any:
    """A fresh fake tensor like real tensor ``x`` (made by the fake mode below); anything else as is."""
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return x


def _meta_outputs(func, args, kwargs) -> list[torch.Tensor] | None:
    """The outputs of ``func`` on meta copies of its (real) inputs, a factory made on the meta device;
    None when the op cannot run there (its output shape depends on values: ``nonzero``, ``item``)."""

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    margs, mkwargs = tree_map(meta, args), tree_map(meta, kwargs)
    if any(a.name == "device" for a in func._schema.arguments):
        mkwargs["device"] = torch.device("meta")
    try:
        with unset_fake_temporarily():
            return _tensors(func(*margs, **mkwargs))
    except (NotImplementedError, RuntimeError):
        return None


@dataclass
class Allocation:
    """One storage: ``nbytes`` from event ``born`` to event ``died`` (None: still alive)."""

    nbytes: int
    term: str
    what: str
    """Shape, dtype, the op that made it and the innermost dflash line that called it."""
    born: int
    died: int | None = None

    def live_at(self, event: int) -> bool:
        return self.born <= event and (self.died is None or self.died > event)


@dataclass(frozen=True)
class Peak:
    """The largest live total seen, what was live then (by term and the largest allocations)."""

    bytes: int
    by_term: dict[str, int]
    largest: list[Allocation]


_TORCH_PREFIX = str(Path(torch.__file__).resolve().parent) + "/"
_HOOKS = ("__torch_function__", "__torch_dispatch__")


def _caller() -> str:
    """The innermost frame outside torch and outside the dispatch machinery (``path:line function``;
    the path relative to this repository when inside it)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name, code = frame.f_code.co_filename, frame.f_code.co_name
        if (
            not name.startswith(_TORCH_PREFIX)
            and name != __file__
            and code not in _HOOKS
            and "contextlib" not in name
        ):
            short = (
                name[len(_REPO_PREFIX) :]
                if name.startswith(_REPO_PREFIX)
                else name.rsplit("site-packages/", 1)[-1]
            )
            return f"{short}:{frame.f_lineno} {code}"
        frame = frame.f_back
    return "?"


class LiveBytes(TorchDispatchMode):
    """Live storage bytes of every tensor an op creates, by term, with the peak (module doc).

    ``describe_bytes``: allocations at least this large record where they were made (a stack walk).
    """

    supports_higher_order_operators = True

    def __init__(self, describe_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.describe_bytes = describe_bytes
        self.current = "other"
        self.allocations: list[Allocation] = []
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[Any] = []
        self.live = 0
        self.event = 0
        self.peak_bytes = 0
        self.peak_event = -1

    @contextmanager
    def term(self, name: str) -> Iterator[None]:
        """Label what is allocated inside with ``name``."""
        old, self.current = self.current, name
        try:
            yield
        finally:
            self.current = old

    def set_term(self, name: str) -> None:
        self.current = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _wrapper_subclass(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        for t in _tensors(out):
            self._add(t, name)
        return out

    def __enter__(self) -> LiveBytes:
        # FSDP2 frees and re-allocates its gathered weights with UntypedStorage.resize_, which no
        # dispatch mode sees (MemTracker patches it likewise)
        original, tracker = torch.UntypedStorage.resize_, self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            tracker._resized(st)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def _add(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        if st in self._by_storage:
            return
        what = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} {op}"
        if st.nbytes() >= self.describe_bytes:
            what += f" at {_caller()}"
        slot: list[Allocation | None] = [None]
        self._by_storage[st] = slot
        self._refs.append(weakref.ref(st, functools.partial(self._on_death, slot)))
        self._open(slot, st.nbytes(), self.current, what)

    def _open(self, slot: list[Allocation | None], nbytes: int, term: str, what: str) -> None:
        self.event += 1
        alloc = Allocation(nbytes, term, what, self.event)
        self.allocations.append(alloc)
        slot[0] = alloc
        self.live += nbytes
        if self.live > self.peak_bytes:
            self.peak_bytes, self.peak_event = self.live, self.event

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A counted storage changed size: its allocation ends and, unless freed, a new one starts."""
        slot = self._by_storage.get(st)
        if slot is None or slot[0] is None and st.nbytes() == 0:
            return
        old = slot[0]
        if old is not None:
            self._free(old)
            slot[0] = None
        if st.nbytes():
            self._open(
                slot, st.nbytes(), old.term if old is not None else self.current, old.what if old else "?"
            )

    def _on_death(self, slot: list[Allocation | None], _ref: object) -> None:
        if slot[0] is not None:
            self._free(slot[0])
            slot[0] = None

    def _free(self, alloc: Allocation) -> None:
        self.event += 1
        alloc.died = self.event
        self.live -= alloc.nbytes

    def live_by_term(self) -> dict[str, int]:
        """Bytes alive now, by term."""
        out: dict[str, int] = defaultdict(int)
        for a in self.allocations:
            if a.died is None:
                out[a.term] += a.nbytes
        return dict(out)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes, self.peak_event = self.live, self.event

    def peak(self, top: int = 10) -> Peak:
        """The peak since the last :meth:`reset_peak`: bytes by term and the ``top`` largest live allocations."""
        live = [a for a in self.allocations if a.live_at(self.peak_event)]
        by_term: dict[str, int] = defaultdict(int)
        for a in live:
            by_term[a.term] += a.nbytes
        largest = sorted(live, key=lambda a: a.nbytes, reverse=True)[:top]
        return Peak(self.peak_bytes, dict(by_term), largest)


@contextmanager
def uncounted_by(*trackers: TorchDispatchMode) -> Iterator[None]:
    """Hide what runs inside from ``trackers``, which must be the innermost modes (entered last)."""
    if not trackers:
        yield
        return
    with _pop_mode_temporarily() as mode:
        if mode not in trackers:
            raise RuntimeError(f"uncounted_by: the innermost dispatch mode is {mode}, not a tracker")
        with uncounted_by(*[t for t in trackers if t is not mode]):
            yield
