"""PacketMaker: the samples of packet g -> headless target forward -> one ``Packet``.

Used by the target ranks (which send the packet to its drafter) and by the co-located ranks
(which train on it in the same process, through ``LocalPackets``). Samples whose hidden states are not finite are dropped
from the packet and counted in it (``num_skipped_nonfinite``); the drafter never sees them. A forward
that runs out of memory is split in halves (the documents are independent) down to one document,
which is dropped and counted (``num_skipped_oom``) when it alone does not fit: a deterministic data
plan would otherwise hit the same packet after every restart.

On CUDA the host waits for the device once per packet: for the per-sample finite flags, which
decide the packet's size (``tests/unit/test_host_syncs.py`` counts it). Everything else is either
host work on host tensors (the plan, the layout, the dropped samples' indices, the attention masks'
shape from the samples' lengths) or non-blocking host-to-device copies (the packet keeps the host copies of its small fields,
``Packet.host``, so a co-located drafter reads none back); a packed row (no padding) is used as it is, never gathered into a copy. The
packet's ``forward_s`` is device time between two CUDA events around the forward on the current
stream (``DeviceClock``), never a device-wide synchronize, which would also wait for this rank's
pending sends and control receive, i.e. for its drafters.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch
from torch import Tensor, nn

from dflash.config import Config
from dflash.distributed.protocol import HostFields, Packet
from dflash.metrics import DeviceClock, peak_memory_gib, reset_peak_memory
from dflash.targets.forward import build_batch, target_forward
from dflash.train import faults
from dflash.train.setup import RunSetup

log = logging.getLogger(__name__)


class PacketMaker:
    """Makes packet g of the data plan with a loaded, frozen target.

    ``own_peak``: the packet's ``peak_mem_bytes`` is the peak of this forward alone (a target rank
    resets the peak counter before it); a co-located rank shares the process with the drafter and
    leaves the counter alone.
    """

    def __init__(
        self, cfg: Config, setup: RunSetup, model: nn.Module, device: torch.device, own_peak: bool = True
    ):
        self.cfg, self.setup, self.model, self.device, self.own_peak = cfg, setup, model, device, own_peak
        self.faults = faults.injected()
        self.nonfinite_sample_ids = set(self.faults.nonfinite_sample_ids)
        self.tensor_parallel = tp_group_size(model) > 1
        self._oom_logged = False
        self._sample_idx: list[int] = []
        self.pad_id = setup.tokenizer.pad_token_id if setup.tokenizer.pad_token_id is not None else 0

    def _put(self, t: Tensor) -> Tensor:
        """A host tensor on the device without waiting (a blocking copy synchronises the stream)."""
        return t.to(self.device, non_blocking=True)

    def _batch(self, samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """``build_batch`` of the samples' token ids (host tensors)."""
        return build_batch([s[0] for s in samples], pack=self.cfg.target.pack, pad_id=self.pad_id)

    def _forward(
        self, ids: Tensor, attn: Tensor | None, pos: Tensor, lens: list[int]
    ) -> tuple[Tensor, Tensor]:
        """The headless target forward of one batch of documents of lengths ``lens``:
        ``(aux [B, L, n_tap*H], final [B, L, H])``; its masks come from ``lens``, not from reading
        the device tensors (``dflash.targets.attention``)."""
        return target_forward(
            self.model,
            self._put(ids),
            None if attn is None else self._put(attn),
            self.setup.layer_ids,
            position_ids=self._put(pos),
            seq_lens=lens,
        )

    def forward_only(self, g: int) -> None:
        """Run the target forward of packet g and discard it: a rank of a tensor-parallel replica
        that is not its sender takes part in the sharded forward (its collectives), nothing else."""
        ds = self.setup.dataset
        samples = [ds.sample(i) for i in self.setup.plan.packet(g).tolist()]
        ids, attn, pos, _ = self._batch(samples)
        self._forward(ids, attn, pos, [s[0].numel() for s in samples])

    def _forward_fitting(
        self, g: int, samples: list[tuple[Tensor, Tensor]], first: int = 0
    ) -> tuple[list[Tensor], list[Tensor], list[int], int]:
        """The headless forward of ``samples`` (padding removed), split in halves while it runs out
        of memory: ``(aux pieces, final pieces, indices of the samples dropped because one alone
        did not fit, number of splits)``, the pieces in sample order. The samples are independent
        documents, so the halves give what the whole gives. A tensor-parallel rank never splits
        alone (its replica's collectives would disagree): its OOM is raised."""
        ids, attn, pos, keep = self._batch(samples)
        lens = [s[0].numel() for s in samples]
        try:
            faults.target_oom(self.faults, sum(lens))
            aux, final = self._forward(ids, attn, pos, lens)
            return [self._real_tokens(aux, keep)], [self._real_tokens(final, keep)], [], 0
        except torch.OutOfMemoryError:
            if self.tensor_parallel:
                raise
            del ids, attn, pos, keep
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if not self._oom_logged:
            self._oom_logged = True
            log.warning(
                "packet %d: the target ran out of memory on %d sample(s), %d tokens (longest %d); splitting "
                "such forwards in halves (perf/target_oom_splits counts them): lower data.token_budget to avoid it",
                g,
                len(samples),
                sum(lens),
                max(lens),
            )
        if len(samples) == 1:
            sid = int(self.setup.dataset.sample_ids[self._sample_idx[first]])
            log.warning(
                "packet %d: sample %d (%d tokens) alone does not fit the target's memory: skipped",
                g,
                sid,
                lens[0],
            )
            return [], [], [first], 0
        half = len(samples) // 2
        a1, f1, d1, n1 = self._forward_fitting(g, samples[:half], first)
        a2, f2, d2, n2 = self._forward_fitting(g, samples[half:], first + half)
        return a1 + a2, f1 + f2, d1 + d2, 1 + n1 + n2

    def make(self, g: int, flags: int = 0) -> Packet:
        """Forward the samples of packet g and assemble the packet (samples that do not fit the
        target's memory alone, and those with non-finite hidden states, dropped)."""
        ds = self.setup.dataset
        sample_idx = self.setup.plan.packet(g).tolist()
        samples = [ds.sample(i) for i in sample_idx]
        if self.own_peak:
            reset_peak_memory(self.device)
        clock = DeviceClock(self.device)
        clock.start()
        self._sample_idx = sample_idx
        auxes, finals, too_big, splits = self._forward_fitting(g, samples)
        if too_big:
            samples = [s for i, s in enumerate(samples) if i not in set(too_big)]
            sample_idx = [x for i, x in enumerate(sample_idx) if i not in set(too_big)]
        lens = torch.tensor([s[0].numel() for s in samples], dtype=torch.long)
        if not samples:
            clock.stop()
            return self._empty(g, flags, clock.seconds(), len(too_big), splits)
        aux, final = _joined(auxes), _joined(finals)
        if self.nonfinite_sample_ids:
            aux = self._inject_nonfinite(aux, sample_idx, lens)
        clock.stop()
        segments = self._put(torch.repeat_interleave(torch.arange(lens.numel()), lens))
        finite = _finite_per_sample(aux, final, segments, lens.numel())  # the packet's one host sync
        forward_s = clock.seconds()
        skipped = int((~finite).sum())
        input_ids = torch.cat([s[0] for s in samples])
        loss_mask = torch.cat([s[1] for s in samples])
        if skipped:
            tok_keep = torch.repeat_interleave(finite, lens)
            rows = self._put(tok_keep.nonzero().squeeze(1))
            aux, final = aux.index_select(0, rows), final.index_select(0, rows)
            input_ids, loss_mask = input_ids[tok_keep], loss_mask[tok_keep]
            lens = lens[finite]
            sample_idx = [i for i, ok in zip(sample_idx, finite.tolist(), strict=True) if ok]
            log.warning("packet %d: dropped %d sample(s) with non-finite hidden states", g, skipped)
        host = HostFields(
            lens, ds.sample_ids[torch.tensor(sample_idx, dtype=torch.long)], loss_mask.to(torch.uint8)
        )
        return Packet(
            index=g,
            input_ids=self._put(input_ids),
            loss_mask=self._put(host.loss_mask),
            seq_lens=self._put(host.seq_lens),
            sample_ids=self._put(host.sample_ids),
            aux_hidden=aux.contiguous(),
            final_hidden=final.contiguous(),
            forward_s=forward_s,
            peak_mem_bytes=int(peak_memory_gib(self.device) * 2**30),
            flags=flags,
            num_skipped_nonfinite=skipped,
            num_skipped_oom=len(too_big),
            oom_splits=splits,
            host=host,  # a co-located drafter reads these, not the device tensors
        )

    def _empty(self, g: int, flags: int, forward_s: float, too_big: int, splits: int) -> Packet:
        """A packet whose every sample was dropped (header only on the wire)."""
        none = torch.zeros(0, dtype=torch.long)
        host = HostFields(none, none, none.to(torch.uint8))
        h = self.setup.meta.hidden_size
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros(0, h, dtype=dtype, device=self.device)
        return Packet(
            index=g,
            input_ids=self._put(none),
            loss_mask=self._put(host.loss_mask),
            seq_lens=self._put(none),
            sample_ids=self._put(none),
            aux_hidden=empty.new_zeros(0, h * len(self.setup.layer_ids)),
            final_hidden=empty,
            forward_s=forward_s,
            peak_mem_bytes=int(peak_memory_gib(self.device) * 2**30),
            flags=flags,
            num_skipped_oom=too_big,
            oom_splits=splits,
            host=host,
        )

    def _real_tokens(self, x: Tensor, keep: Tensor) -> Tensor:
        """``[B, L, D]`` -> ``[T, D]``, padding removed (``build_batch``'s ``keep``, strictly increasing):
        a view when nothing is padded (a packed row, or rows of one length), else a gather."""
        flat = x.reshape(-1, x.shape[-1])
        if keep.numel() == flat.shape[0]:
            return flat
        return flat.index_select(0, self._put(keep))

    def _inject_nonfinite(self, aux: Tensor, sample_idx: list[int], lens: Tensor) -> Tensor:
        """Fault injection: NaN hidden states for the configured source sample ids."""
        bad = self.nonfinite_sample_ids
        src = self.setup.dataset.sample_ids[torch.tensor(sample_idx, dtype=torch.long)].tolist()
        hit = torch.tensor([s in bad for s in src])
        if not hit.any():
            return aux
        rows = torch.repeat_interleave(hit, lens).nonzero().squeeze(1)
        return aux.clone().index_fill_(0, self._put(rows), float("nan"))


def _joined(pieces: list[Tensor]) -> Tensor:
    """The forward's pieces in sample order (a view when there is one: nothing was split)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def tp_group_size(model: nn.Module) -> int:
    """Ranks a target's weights are sharded over (DTensor parameters), 1 for a whole target (or a
    module without parameters)."""
    p = next(model.parameters(), None)
    mesh = getattr(p, "device_mesh", None)
    return int(mesh.size()) if mesh is not None else 1


def _finite_per_sample(aux: Tensor, final: Tensor, segments: Tensor, num_samples: int) -> Tensor:
    """[S] bool on the host: every hidden value of the sample is finite. ``segments`` [T] (on the
    device) is each token's sample; one device-to-host copy of S flags."""
    tok_bad = ~(torch.isfinite(aux).all(dim=1) & torch.isfinite(final).all(dim=1))
    bad = torch.zeros(num_samples, dtype=torch.long, device=aux.device).index_add_(
        0, segments, tok_bad.long()
    )
    return (bad == 0).cpu()


class PacketSource(Protocol):
    """Where a drafter's packets come from: a ``DrafterLink`` (targets) or ``LocalPackets``."""

    last_wait_s: float

    def recv(self, g: int) -> Packet: ...

    def ack(self, g: int) -> None: ...

    def prefetch(self, g: int) -> None: ...

    def set_timeout(self, seconds: float) -> None: ...

    def first_step_done(self) -> None: ...

    def stop_all(self) -> int: ...


class LocalPackets:
    """The packet source of a co-located rank: ``recv(g)`` runs this rank's own target forward.

    Nothing is waited for (``last_wait_s`` stays 0; the forward time is the packet's ``forward_s``)
    and nothing is in flight, so ``ack``/``prefetch``/``first_step_done`` do nothing and
    ``stop_all`` discards nothing. The hidden states come out of the target's ``inference_mode``
    forward, which autograd cannot save for the drafter's backward: the drafter gets a copy (what a
    drafter rank receives over the wire is an ordinary tensor already).
    """

    def __init__(self, maker: PacketMaker) -> None:
        self.maker = maker
        self.last_wait_s = 0.0

    def recv(self, g: int) -> Packet:
        packet = self.maker.make(g)
        return dataclasses.replace(
            packet, aux_hidden=packet.aux_hidden.clone(), final_hidden=packet.final_hidden.clone()
        )

    def ack(self, g: int) -> None:
        pass

    def prefetch(self, g: int) -> None:
        pass

    def set_timeout(self, seconds: float) -> None:
        pass

    def first_step_done(self) -> None:
        pass

    def stop_all(self) -> int:
        return 0
