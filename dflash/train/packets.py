"""PacketMaker: the samples of packet g -> headless target forward -> one ``Packet``.

Used by the target ranks (which send the packet to its drafter) and by the co-located ranks
(which train on it in the same process, through ``LocalPackets``). Samples whose hidden states are not finite are dropped
from the packet and counted in it (``num_skipped_nonfinite``); the drafter never sees them.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
from torch import nn

from dflash.config import Config
from dflash.distributed.protocol import Packet
from dflash.metrics import peak_memory_gib, reset_peak_memory
from dflash.targets.forward import build_batch, target_forward
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
        self.pad_id = setup.tokenizer.pad_token_id if setup.tokenizer.pad_token_id is not None else 0

    def make(self, g: int, flags: int = 0) -> Packet:
        """Forward the samples of packet g and assemble the packet (non-finite samples dropped)."""
        ds = self.setup.dataset
        sample_idx = self.setup.plan.packet(g).tolist()
        samples = [ds.sample(i) for i in sample_idx]
        if self.own_peak:
            reset_peak_memory(self.device)
        t0 = time.perf_counter()
        ids, attn, pos, keep = build_batch(
            [s[0] for s in samples], pack=self.cfg.target.pack, pad_id=self.pad_id
        )
        aux, final = target_forward(
            self.model,
            ids.to(self.device),
            None if attn is None else attn.to(self.device),
            self.setup.layer_ids,
            position_ids=pos.to(self.device),
        )
        aux = aux.reshape(-1, aux.shape[-1])[keep.to(self.device)]
        final = final.reshape(-1, final.shape[-1])[keep.to(self.device)]
        lens = torch.tensor([s[0].numel() for s in samples], dtype=torch.long)
        if self.cfg.fault.nonfinite_sample_ids:
            aux = self._inject_nonfinite(aux, sample_idx, lens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        forward_s = time.perf_counter() - t0
        finite = _finite_per_sample(aux, final, lens)
        skipped = int((~finite).sum())
        input_ids = torch.cat([s[0] for s in samples])
        loss_mask = torch.cat([s[1] for s in samples])
        if skipped:
            tok_keep = torch.repeat_interleave(finite, lens)
            aux, final = aux[tok_keep.to(self.device)], final[tok_keep.to(self.device)]
            input_ids, loss_mask = input_ids[tok_keep], loss_mask[tok_keep]
            lens = lens[finite]
            sample_idx = [i for i, ok in zip(sample_idx, finite.tolist(), strict=True) if ok]
            log.warning("packet %d: dropped %d sample(s) with non-finite hidden states", g, skipped)
        return Packet(
            index=g,
            input_ids=input_ids.to(self.device),
            loss_mask=loss_mask.to(torch.uint8).to(self.device),
            seq_lens=lens.to(self.device),
            sample_ids=ds.sample_ids[torch.tensor(sample_idx, dtype=torch.long)].to(self.device),
            aux_hidden=aux.contiguous(),
            final_hidden=final.contiguous(),
            forward_s=forward_s,
            peak_mem_bytes=int(peak_memory_gib(self.device) * 2**30),
            flags=flags,
            num_skipped_nonfinite=skipped,
        )

    def _inject_nonfinite(self, aux: torch.Tensor, sample_idx: list[int], lens: torch.Tensor) -> torch.Tensor:
        """Fault injection: NaN hidden states for the configured source sample ids."""
        bad = set(self.cfg.fault.nonfinite_sample_ids)
        src = self.setup.dataset.sample_ids[torch.tensor(sample_idx, dtype=torch.long)].tolist()
        hit = torch.tensor([s in bad for s in src])
        if not hit.any():
            return aux
        aux = aux.clone()
        aux[torch.repeat_interleave(hit, lens).to(aux.device)] = float("nan")
        return aux


def _finite_per_sample(aux: torch.Tensor, final: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[S] bool: every hidden value of the sample is finite."""
    tok_ok = torch.isfinite(aux).all(dim=1) & torch.isfinite(final).all(dim=1)
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens).to(tok_ok.device)
    bad = torch.zeros(lens.numel(), dtype=torch.long, device=tok_ok.device).index_add_(
        0, seg, (~tok_ok).long()
    )
    return (bad == 0).cpu()


class PacketSource(Protocol):
    """Where a drafter's packets come from: a ``DrafterLink`` (targets) or ``LocalPackets``."""

    last_wait_s: float

    def recv(self, g: int) -> Packet: ...

    def ack(self, g: int) -> None: ...

    def prefetch(self, g: int) -> None: ...

    def set_timeout(self, seconds: float) -> None: ...

    def stop_all(self) -> int: ...


class LocalPackets:
    """The packet source of a co-located rank: ``recv(g)`` runs this rank's own target forward.

    Nothing is waited for (``last_wait_s`` stays 0; the forward time is the packet's ``forward_s``)
    and nothing is in flight, so ``ack``/``prefetch`` do nothing and ``stop_all`` discards nothing.
    """

    def __init__(self, maker: PacketMaker) -> None:
        self.maker = maker
        self.last_wait_s = 0.0

    def recv(self, g: int) -> Packet:
        return self.maker.make(g)

    def ack(self, g: int) -> None:
        pass

    def prefetch(self, g: int) -> None:
        pass

    def set_timeout(self, seconds: float) -> None:
        pass

    def stop_all(self) -> int:
        return 0
