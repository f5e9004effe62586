"""TargetWorker: data plan -> headless target forward -> packet -> send to the drafter.

Target rank t produces the packets g with g mod N == t, from the resume point the drafter leader
broadcasts, in order, never more than ``topology.max_in_flight`` ahead of the drafter's ACKs.
Samples whose hidden states are not finite are dropped from the packet and counted in its header;
the drafter never sees them.
"""

from __future__ import annotations

import logging
import signal
import time

import torch

from dflash import faults
from dflash.config import Config
from dflash.distributed.collectives import agree_on_start
from dflash.distributed.links import TargetLink
from dflash.distributed.process_group import DistContext, set_timeout
from dflash.distributed.protocol import FLAG_STOP_REQUESTED, Packet, PacketSpec
from dflash.distributed.topology import linked_drafters
from dflash.metrics import peak_memory_gib, reset_peak_memory
from dflash.setup import RunSetup, torch_dtype
from dflash.targets.forward import build_batch, target_forward
from dflash.targets.loader import load_target

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""As the drafter's: ask the drafters to stop with a checkpoint."""


class TargetWorker:
    """The target role (ranks 0..N-1): frozen model, forward passes, packets."""

    def __init__(self, cfg: Config, setup: RunSetup, ctx: DistContext) -> None:
        self.cfg, self.setup, self.ctx = cfg, setup, ctx
        self.topology = setup.topology
        self.device = ctx.device
        self.dtype = torch_dtype(cfg.target.dtype, self.device)
        self.stop_requested = False
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        self.model = load_target(cfg.target, self.device, self.dtype)
        self.pad_id = setup.tokenizer.pad_token_id if setup.tokenizer.pad_token_id is not None else 0
        spec = PacketSpec(
            num_taps=len(setup.layer_ids),
            hidden_size=setup.meta.hidden_size,
            dtype=self.dtype,
            max_tokens=cfg.data.token_budget,
            device=self.device,
        )
        self.links = {
            d: TargetLink(
                self.topology,
                ctx.rank,
                d,
                spec,
                cfg.topology.init_timeout_s,
                cfg.topology.max_in_flight,
                control_group=ctx.control_group,
            )
            for d in linked_drafters(self.topology, ctx.rank)
        }

    def _on_signal(self, signum: int, frame: object) -> None:
        log.warning(
            "target rank %d: got signal %d; asking the drafter to stop at the next step",
            self.ctx.rank,
            signum,
        )
        self.stop_requested = True

    def close(self, exit_code: int = 0) -> None:
        for s, h in self._previous_handlers.items():
            signal.signal(s, h)

    def make_packet(self, g: int) -> Packet:
        """Forward the samples of packet g and assemble the packet (non-finite samples dropped)."""
        ds = self.setup.dataset
        sample_idx = self.setup.plan.packet(g).tolist()
        samples = [ds.sample(i) for i in sample_idx]
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
        finite = self._finite_per_sample(aux, final, lens)
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
            flags=FLAG_STOP_REQUESTED if self.stop_requested else 0,
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

    @staticmethod
    def _finite_per_sample(aux: torch.Tensor, final: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """[S] bool: every hidden value of the sample is finite."""
        tok_ok = torch.isfinite(aux).all(dim=1) & torch.isfinite(final).all(dim=1)
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens).to(tok_ok.device)
        bad = torch.zeros(lens.numel(), dtype=torch.long, device=tok_ok.device).index_add_(
            0, seg, (~tok_ok).long()
        )
        return (bad == 0).cpu()

    def run(self) -> int:
        """Produce this target's packets until the last one or the drafters' STOP; returns 0."""
        start, num_steps = agree_on_start(self.ctx, self.topology, 0, self.setup.num_steps)
        end = num_steps * self.topology.packets_per_step
        sent = 0
        # A drafter may itself wait up to step_timeout_s for another target's packet: wait twice that for
        # it, so that a stuck target is reported by the drafter waiting on it, not by a peer as a stuck drafter.
        drafter_timeout = 2 * self.cfg.topology.step_timeout_s
        for g in self.topology.packets_of_target(self.ctx.rank, start, end):
            if any(link.stopped for link in self.links.values()):
                break
            faults.at_step(self.cfg.fault, self.ctx.rank, g // self.topology.packets_per_step + 1)
            link = self.links[self.topology.consumer_of(g)]
            link.send(self.make_packet(g))
            if link.num_acked and link.timeout_s != drafter_timeout:
                # The drafter has loaded and trained on this link's packets: init_timeout_s is over.
                link.set_timeout(drafter_timeout)
                set_timeout(self.ctx, drafter_timeout)
            sent += 1
        for link in self.links.values():
            link.wait_for_stop()
            link.send_end()
        log.info("target rank %d done: %d packets sent", self.ctx.rank, sent)
        return 0
