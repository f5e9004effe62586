"""DrafterTrainer: recv packets -> DFlash objective -> optimizer step -> metrics -> checkpoint.

One optimizer step of drafter d consumes the packets ``Topology.packets_of_step(step, rank)``.
Each packet is one packed row of several sequences; its loss numerator (sum_r w_r*l_r) is
back-propagated, and at the step boundary the gradients (all-reduced over the drafters when M > 1)
are divided by the global weight sum, so the loss is the global token mean whatever the packing.
Anchors come from a generator seeded with (train.seed, packet index): a resumed run samples
exactly what the uninterrupted run sampled.

One module because one class owns the drafter rank's loop and its state (model, optimizer, schedule,
sums, links, checkpoints); the pieces that stand alone live beside it (``step_stats``,
``checkpoint``, ``periodic_eval``, ``summary``, ``dflash.distributed.drafter_parallel``).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import PreTrainedModel

from dflash.cli import log_to_files
from dflash.config import EXIT_STOPPED, STOP_SIGNALS, Config, plain_dict
from dflash.config.resolve import drafter_sharded, resolve_path, torch_dtype
from dflash.distributed.collectives import (
    agree_on_start,
    all_reduce_max,
    all_reduce_sum,
    gather_lists,
)
from dflash.distributed.drafter_parallel import drafter_parallel
from dflash.distributed.links import DrafterLink, PeerError
from dflash.distributed.process_group import DistContext, set_timeout
from dflash.distributed.protocol import FLAG_STOP_REQUESTED, Packet, host_fields
from dflash.drafter.export import export_drafter, load_exported, load_into
from dflash.drafter.families import build_drafter
from dflash.drafter.model import DFlashDraftModel, num_parameters
from dflash.drafter.objective import ObjectiveOutput, selector_coefficient
from dflash.drafter.optim import LrSchedule, build_optimizer, build_scheduler, group_lrs, peak_lrs
from dflash.drafter.step import PacketAnchors, StepPlan, objective_step, plan_anchors
from dflash.loss.terms import coefficients
from dflash.metrics import (
    MetricLogger,
    NullLogger,
    PhaseTimer,
    build_logger,
    default_run_name,
    human_count,
    peak_memory_gib,
    progress_bar,
    reset_peak_memory,
)
from dflash.sizing import AttentionKind, PacketCosts, PacketShape, packet_costs
from dflash.sizing.inputs import attention_kinds
from dflash.targets.loader import load_embed_and_head, load_target, target_embed_and_head
from dflash.train import faults
from dflash.train.checkpoint import LoadedCheckpoint, TrainState, latest_checkpoint, save_checkpoint
from dflash.train.levers import resolve_levers
from dflash.train.packets import LocalPackets, PacketMaker, PacketSource
from dflash.train.periodic_eval import EVAL_SUMS, PeriodicEval, eval_budget_s, eval_metrics
from dflash.train.rng_state import capture_rng_state, restore_rng_state
from dflash.train.run_dir import SCHEDULE_KEYS
from dflash.train.setup import RunSetup
from dflash.train.step_stats import StepSums, step_metrics
from dflash.train.steplog import StepLog
from dflash.train.summary import (
    METRICS_FILE,
    RunSummary,
    balance_line,
    eval_line,
    jsonable,
    recent_figures,
    status_line,
    step_line,
    summary_table,
)

log = logging.getLogger(__name__)

EMPTY_STEPS_LIMIT = 3
"""Optimizer steps in a row without a supervised slot that stop the run (it would train on nothing)."""


@dataclass
class _StepLocal:
    """What one drafter gathered over its packets of a step, before the all-reduces."""

    sums: StepSums
    target_fwd: torch.Tensor
    """[num_targets] float64: forward seconds of this drafter's packets, per producing target."""
    target_mem: torch.Tensor
    """[num_targets] float64: the largest peak memory (GiB) those packets report, per target."""
    target_packets: torch.Tensor
    """[num_targets] float64: how many of this drafter's packets each target produced."""
    trained: list[int] = field(default_factory=list)
    """Per packet: g, its number of samples, their source ids (the ledger's raw material)."""
    shapes: list[PacketShape] = field(default_factory=list)
    anchors_offered: int = 0
    """The anchors ``drafter.num_anchors`` offers in these packets before ``max_anchors_per_packet``
    (counted on the host copies)."""
    packets_cut: int = 0
    """The packets of which ``max_anchors_per_packet`` kept fewer anchors than were offered."""
    selector_scale: float = 0.0
    """DFlash2's selector loss coefficient at this step (``selector_coefficient``)."""


@dataclass
class _StepReduced:
    """The step over every drafter: summed sums, per-target forward time, peak memories."""

    sums: StepSums
    target_fwd: torch.Tensor
    target_mem: torch.Tensor
    drafter_mem: torch.Tensor
    target_packets: torch.Tensor
    """[num_targets]: packets each target produced in the step (a target with none logs nothing)."""


class DrafterTrainer:
    """The drafter role (rank >= num_targets; every rank when co-located). ``run()`` trains,
    ``close()`` releases everything.

    Packets come from a ``DrafterLink`` (the targets send them) or, co-located, from a
    ``LocalPackets`` that runs this rank's own target: the step is the same either way.
    """

    def __init__(
        self, cfg: Config, setup: RunSetup, ctx: DistContext, run_dir: Path, resume: LoadedCheckpoint | None
    ) -> None:
        self.cfg, self.setup, self.ctx, self.run_dir = cfg, setup, ctx, run_dir
        self.topology = setup.topology
        self.device = ctx.device
        self.is_leader = ctx.rank == self.topology.leader_rank
        self.drafter_index = self.topology.drafter_index(ctx.rank)
        self.stop_requested = False
        """This rank got a stop signal (it joins the next step's agreement)."""
        self.stop_agreed = False
        """Some rank (a drafter, or a target through its packets) asked to stop: every drafter stops
        after the same step."""
        self.stop_signal: str | None = None
        self.faults = faults.injected()
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        self.target_dtype = torch_dtype(cfg.target.dtype, self.device)
        self._cut_warned = False
        block_chunks, self.checkpoint_layers = self._levers()
        self.step_plan = StepPlan.for_training(
            cfg,
            setup.arch.block_size,
            device=self.device.type,
            token_budget=setup.data.token_budget,
            block_chunks=block_chunks,
            skip_empty_chunks=not drafter_sharded(str(cfg.drafter.shard), self.topology.num_drafters),
        )
        target = self._packet_source()
        self.embed, self.head = self._embed_and_head(target)
        self.model = self._build_model()
        self.parallel = drafter_parallel(self.model, ctx, str(cfg.drafter.shard), self.topology.num_drafters)
        self.optimizer = build_optimizer(list(self.model.parameters()), cfg.optim, self.model.lookup_tables())
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, setup.num_steps)
        self.state = TrainState(skipped=dict(setup.dataset.skipped))
        if resume is not None:
            self._restore(resume)
        self.evaluator = None
        if cfg.eval.every > 0:
            self.evaluator = PeriodicEval(
                cfg,
                setup,
                self.device,
                drafter_index=self.drafter_index,
                num_drafters=self.topology.num_drafters,
                target=target,
            )
        self._open_run_files()
        self.phases = PhaseTimer(self.device, sync=cfg.train.time_phases)
        self._empty_steps = 0
        self.train_s = 0.0
        """Seconds of training steps in this launch (the periodic eval's budget is a share of them)."""
        self.eval_s = 0.0
        """Seconds of periodic evals in this launch."""
        log.info(
            "drafter: %s trainable parameters, attention=%s, %d steps from step %d",
            human_count(num_parameters(self.model)),
            self.step_plan.attention,
            setup.num_steps,
            self.state.step,
        )

    def _packet_source(self) -> PreTrainedModel | None:
        """``self.source``: a ``DrafterLink`` from the targets, or (co-located) ``LocalPackets`` over
        this rank's own target, which is returned (else None)."""
        cfg, setup = self.cfg, self.setup
        if not self.topology.self_produced:
            self.source: PacketSource = DrafterLink(
                self.topology,
                self.ctx.rank,
                setup.packet_spec(self.target_dtype, self.device),
                cfg.topology.init_timeout_s,
                groups=self.ctx.drafter_links(),
            )
            return None
        target = load_target(cfg.target, self.device, self.target_dtype)
        self.source = LocalPackets(PacketMaker(cfg, setup, target, self.device, own_peak=False))
        return target

    def _embed_and_head(self, target: PreTrainedModel | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen embedding and lm_head: the co-located target's own tensors (no second copy),
        the same random target's (``target.random_weights``), else read by name from the checkpoint."""
        cfg = self.cfg
        if target is None and cfg.target.random_weights:
            target = load_target(cfg.target, self.device, self.target_dtype)
        embed, head = target_embed_and_head(target) if target is not None else (None, None)
        if embed is None or head is None:
            embed, head = load_embed_and_head(self.setup.target_path, revision=cfg.target.revision)
        return embed.to(self.device, self.target_dtype), head.to(self.device, self.target_dtype)

    def _build_model(self) -> DFlashDraftModel:
        """The drafter, initialised from ``train.seed`` or warm-started from ``drafter.init_from``,
        its layers checkpointed when ``drafter.activation_checkpointing`` says so (auto: when the
        planner finds that this role does not fit its device without it; every drafter agrees) and
        compiled on CUDA unless ``drafter.compile=false`` (before FSDP2 shards them, as torchtitan)."""
        model = build_drafter(self.setup.arch)
        model.reset_parameters(seed=self.cfg.train.seed)
        if self.cfg.drafter.init_from:
            _, state = load_exported(resolve_path(self.cfg.drafter.init_from))
            load_into(model, state)
            log.info("warm start from %s", self.cfg.drafter.init_from)
        model.checkpoint_layers = self.checkpoint_layers
        if self.cfg.drafter.compile and self.device.type == "cuda":
            model.compile_layers(dynamic=False if self.step_plan.attention == "flex" else None)
        return model.to(self.device)

    def _levers(self) -> tuple[int, bool]:
        """``drafter.block_chunks`` and ``drafter.activation_checkpointing`` resolved for this rank's
        device (:func:`dflash.train.levers.resolve_levers`, logged), the same on every drafter: the
        most chunks any needs, checkpointing if any needs it (FSDP2's collectives are per chunk)."""
        levers = resolve_levers(self.cfg, self.device, self.topology.world_size)
        mine = torch.tensor([float(levers.block_chunks), float(levers.checkpoint)], device=self.device)
        chunks, checkpoint = (int(x) for x in all_reduce_max(self.ctx, mine).cpu().tolist())
        for reason in levers.reasons:
            log.info("%s", reason)
        if (chunks, bool(checkpoint)) != (levers.block_chunks, levers.checkpoint):
            log.info(
                "another drafter needs more: %d block chunks, checkpointing %s",
                chunks,
                "on" if checkpoint else "off",
            )
        return chunks, bool(checkpoint)

    def _open_run_files(self) -> None:
        """The leader's W&B run and the run's ledger and metrics files (what was written after the
        resumed checkpoint is trained again, so it is cut off here)."""
        cfg = self.cfg
        self.logger: MetricLogger = NullLogger()
        if self.is_leader:
            config = plain_dict(OmegaConf.structured(cfg))
            self.logger = build_logger(
                cfg.logging,
                True,
                self.run_dir,
                config,
                default_run_name(self.run_dir),
                resume_id=self.state.wandb_run_id,
            )
            self.state.wandb_run_id = self.logger.run_id
        self.ledger = StepLog(self.run_dir / "ledger.jsonl")
        self.metrics_log = StepLog(self.run_dir / METRICS_FILE, step_key="train/step")
        if self.is_leader:
            if cfg.train.ledger:
                self.ledger.truncate(self.state.step)
            self.metrics_log.truncate(self.state.step)
        self.summary = RunSummary(self.setup.num_steps)

    # ---------------------------------------------------------------- lifecycle
    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signal.Signals(signum).name
        log.warning(
            "drafter rank %d: got %s; stopping with a checkpoint at the next step boundary",
            self.ctx.rank,
            self.stop_signal,
        )
        self.stop_requested = True

    def _restore(self, loaded: LoadedCheckpoint) -> None:
        if loaded.state_dir is not None:  # DCP shards, of any number of drafters
            self.parallel.load_shards(self.optimizer, loaded.state_dir)
        else:
            assert loaded.model_state is not None and loaded.optimizer_state is not None
            self.parallel.load(self.optimizer, loaded.model_state, loaded.optimizer_state)
        self.scheduler.load_state_dict(loaded.scheduler_state)
        restore_rng_state(loaded.rng_state)
        self.state = loaded.train_state
        log.info(
            "resumed from %s at step %d (packet %d)", loaded.path, self.state.step, self.state.next_packet
        )
        self._replan_schedule(loaded.contract)

    def _replan_schedule(self, saved: dict) -> None:
        """A resume whose schedule settings changed (``train.allow_contract_change=true``: optim.lr,
        optim.muon_lr, warmup_ratio, min_lr_ratio, train.num_steps) applies them from the resumed step
        on, starting from the multiplier of the peak the run had reached (each group's learning rate
        times its new over its old peak)."""
        now = self.setup.contract
        changed = [k for k in SCHEDULE_KEYS if saved.get(k) != now.get(k)]
        if not changed:
            return
        cfg, step = self.cfg.optim, self.state.step
        groups = self.optimizer.param_groups
        factor = float(self.scheduler.get_last_lr()[0]) / float(groups[0]["initial_lr"])
        schedule = self.scheduler.lr_lambdas[0]
        assert isinstance(schedule, LrSchedule)
        schedule.replan(step, factor, cfg, self.setup.num_steps)
        peaks = peak_lrs(cfg)
        self.scheduler.base_lrs = list(peaks)
        lrs: list[float | torch.Tensor] = [peak * schedule(step) for peak in peaks]
        for group, peak, lr in zip(groups, peaks, lrs, strict=True):
            group["initial_lr"], group["lr"] = peak, lr
        self.scheduler._last_lr = lrs
        low = cfg.lr * cfg.min_lr_ratio
        log.warning(
            "resumed with changed %s: the learning rate continues from %.4g at step %d down to %.4g at step %d%s",
            ", ".join(changed),
            float(lrs[0]),
            step,
            low,
            self.setup.num_steps,
            " (the run had reached its minimum: extend a run before its end, or warm-start a new run with "
            "drafter.init_from=<run>/drafter for a new schedule)"
            if float(lrs[0]) <= low * (1 + 1e-9)
            else "",
        )

    def close(self, exit_code: int = 0) -> None:
        self.logger.close(exit_code)
        for s, h in self._previous_handlers.items():
            signal.signal(s, h)

    # ---------------------------------------------------------------- one step
    def _forward_packet(self, packet: Packet, local: _StepLocal) -> ObjectiveOutput:
        """The objective of one packet (``dflash.drafter.step``); its offered anchors (before the
        per-packet cap) and its shape as trained go to ``local``.

        Host syncs: none beyond ``host_fields`` (one copy, already made by a ``DrafterLink``). The
        anchors are drawn on the host from its copies (CPU generator), and what the host then knows
        (positions, anchors, the supervised row count R) goes to the device without a read back."""
        host = host_fields(packet)
        anchors = plan_anchors(self.step_plan, host.seq_lens, host.loss_mask, packet.index)
        local.anchors_offered += anchors.offered
        local.packets_cut += int(anchors.num_blocks < anchors.offered)
        local.shapes.append(self._packet_shape(packet, anchors))
        return objective_step(
            self.model,
            self.embed,
            self.head,
            packet.aux_hidden,
            packet.final_hidden,
            packet.input_ids.to(self.device),
            packet.loss_mask.to(self.device),
            anchors,
            self.step_plan,
            on_phase=self.phases.mark,
            selector_scale=local.selector_scale,
            partial_backward=self.parallel.partial_backward,
        )

    def _next_packet(self, step: int, i: int, packets: list[int]) -> int | None:
        """The packet this drafter trains on after ``packets[i]`` (None after the last step)."""
        if i + 1 < len(packets):
            return packets[i + 1]
        if step + 1 < self.setup.num_steps:
            return self.topology.packets_of_step(step + 1, self.ctx.rank)[0]
        return None

    def train_step(self, step: int) -> dict[str, float]:
        """Optimizer step ``step`` (0-based) over this drafter's packets; returns global metrics.

        The packets' losses are weighted sums (``normalizer=1``): their gradients are summed over
        the step's packets and the drafters, then divided once by the global weight sum, so the
        update follows the global token mean whatever the packing and the split."""
        t0 = time.perf_counter()
        faults.at_step(self.faults, self.ctx.rank, step + 1)
        self.optimizer.zero_grad(set_to_none=False)
        local = self._accumulate(step)
        faults.slow_step(self.faults, self.ctx.rank, step + 1)
        self.parallel.finish(self.source_timeout)
        reduced = self._reduce(step, local, t0)
        grad_norm, lrs = self._apply_update(step, reduced.sums)
        self._advance(step, reduced.sums, local.trained)
        metrics = self._metrics(reduced, t0, lrs, grad_norm)
        self._warn_cut(metrics)
        return metrics

    def _warn_cut(self, m: dict[str, float]) -> None:
        """Leader, once per launch: the first step whose packets ``drafter.max_anchors_per_packet``
        cut (fewer anchors per sample than the recipe's ``drafter.num_anchors``) is named, with the cap
        and the levers that restore the recipe."""
        if self._cut_warned or m["train/packets_cut"] <= 0:
            return
        self._cut_warned = True
        if not self.is_leader:
            return
        d = self.cfg.drafter
        log.warning(
            "drafter.max_anchors_per_packet=%s cut the anchors of %d of this step's %d packets: %.0f anchors "
            "per sample trained of the %.0f that the recipe (drafter.num_anchors=%d) offers; every cut anchor's "
            "target forward is paid anyway. Raise drafter.max_anchors_per_packet (python -m dflash.plan names "
            "the largest that fits, with drafter.block_chunks) or lower data.token_budget",
            d.max_anchors_per_packet,
            int(m["train/packets_cut"]),
            self.topology.packets_per_step,
            m["train/anchors_per_sample"],
            m["train/anchors_offered_per_sample"],
            d.num_anchors,
        )

    def _accumulate(self, step: int) -> _StepLocal:
        """Receive, forward and backward this drafter's packets of the step (gradients summed)."""
        packets = self.topology.packets_of_step(step, self.ctx.rank)
        n_targets = max(self.topology.num_targets, 1)
        local = _StepLocal(
            sums=StepSums(self.setup.arch.block_size, self.device),
            target_fwd=torch.zeros(n_targets, dtype=torch.float64),
            target_mem=torch.zeros(n_targets, dtype=torch.float64),
            target_packets=torch.zeros(n_targets, dtype=torch.float64),
            selector_scale=selector_coefficient(self.setup.cfg.loss, step),
        )
        self.phases.start()
        for i, g in enumerate(packets):
            packet = self.source.recv(g)
            self.phases.mark("target_forward" if self.topology.self_produced else "recv_wait")
            self.source.ack(g)
            following = self._next_packet(step, i, packets)
            if following is not None:
                self.source.prefetch(following)  # double buffering: its header, or its payload if in
            self._count_packet(packet, local)
            if i == len(packets) - 1:
                self.parallel.arm()  # the last backward of the step overlaps the gradient reduction
            if packet.num_tokens == 0:
                continue
            with self.parallel.forward():
                out = self._forward_packet(packet, local)
            loss = out.loss
            if faults.nan_loss(self.faults, step + 1):
                loss = loss * float("nan")
            local.sums.count_nonfinite(loss)
            self.parallel.backward(loss)
            if following is not None:
                self.source.prefetch(following)  # the compute is queued: its payload moves beside it
            self.phases.mark("backward")
            local.sums.add(out)
        return local

    def _count_packet(self, packet: Packet, local: _StepLocal) -> None:
        """The packet's header figures into the step's counters (times, memory, flags, samples)."""
        c = local.sums.counters
        c["wait_s"] += self.source.last_wait_s
        c["target_s"] += packet.forward_s
        slot = 0 if self.topology.self_produced else self.topology.producer_replica(packet.index)
        local.target_fwd[slot] += packet.forward_s
        local.target_packets[slot] += 1
        local.target_mem[slot] = max(float(local.target_mem[slot]), packet.peak_mem_bytes / 2**30)
        c["stop"] += float(bool(packet.flags & FLAG_STOP_REQUESTED))
        c["nonfinite_samples"] += packet.num_skipped_nonfinite
        c["oom_samples"] += packet.num_skipped_oom
        c["oom_splits"] += packet.oom_splits
        ids = host_fields(packet).sample_ids.tolist()
        local.trained += [packet.index, len(ids), *ids]
        c["tokens"] += packet.num_tokens
        c["seqs"] += packet.num_seqs

    def _reduce(self, step: int, local: _StepLocal, t0: float) -> _StepReduced:
        """The step's sums over every drafter (one all-reduce of the sums, one of the per-target
        forward times, one max of the peak memories) and the stop agreement."""
        c = local.sums.counters
        c["stop"] += float(self.stop_requested)
        c["anchors_offered"] = float(local.anchors_offered)
        c["packets_cut"] = float(local.packets_cut)
        c["wall_s"] = time.perf_counter() - t0
        c["busy_s"] = c["wall_s"] - c["wait_s"] - (c["target_s"] if self.topology.self_produced else 0.0)
        if self._logged(step + 1):  # the cost model runs for the rows that are logged, not per packet
            for shape in local.shapes:
                costs = self._costs(shape)
                c["target_flop"] += costs.target_flop
                c["drafter_flop"] += costs.drafter_flop
        sums = local.sums
        sums.load(all_reduce_sum(self.ctx, sums.flat().to(self.device)).cpu())
        per_target = torch.cat([local.target_fwd, local.target_packets])
        target_fwd, target_packets = all_reduce_sum(self.ctx, per_target.to(self.device)).cpu().chunk(2)
        drafter_mem = torch.zeros(self.topology.num_drafters, dtype=torch.float64)
        drafter_mem[self.drafter_index] = peak_memory_gib(self.device)
        mem = all_reduce_max(self.ctx, torch.cat([local.target_mem, drafter_mem]).to(self.device)).cpu()
        n_targets = local.target_mem.numel()
        self.stop_agreed = self.stop_agreed or sums.counters["stop"] > 0
        if sums.counters["stop"] > 0 and self.stop_signal is None:
            self.stop_signal = "a stop signal of another rank"
        self.phases.mark("reduce")
        return _StepReduced(sums, target_fwd, mem[:n_targets], mem[n_targets:], target_packets)

    def _apply_update(self, step: int, sums: StepSums) -> tuple[float, list[float]]:
        """Divide the summed gradients by the global weight sum, clip, and step the optimizer unless
        the loss or the gradient is not finite (``train.on_nonfinite``); returns (grad norm, each
        parameter group's lr)."""
        cfg = self.cfg
        weight_sum = float(sums.objective["weight_sum"])
        self._check_trained_on_something(step, weight_sum)
        scale = 1.0 / weight_sum if weight_sum > 0 else 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = self.parallel.clip(cfg.optim.max_grad_norm)
        lrs = [float(lr) for lr in self.scheduler.get_last_lr()]
        if weight_sum == 0:
            log.warning("step %d: no packet of the step held a supervised slot; nothing trained", step + 1)
        elif sums.counters["nonfinite_loss"] > 0 or not math.isfinite(grad_norm):
            self.state.nonfinite_steps += 1
            if cfg.train.on_nonfinite == "error":
                raise RuntimeError(
                    f"drafter rank {self.ctx.rank}: loss or gradient not finite at step {step + 1} "
                    f"(grad_norm={grad_norm}); the optimizer step was not applied. "
                    f"Set train.on_nonfinite=skip to skip such steps instead"
                )
            log.warning(
                "step %d: loss or gradient not finite on drafter rank %d; step skipped",
                step + 1,
                self.ctx.rank,
            )
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.phases.mark("optimizer")
        return grad_norm, lrs

    def _advance(self, step: int, sums: StepSums, trained: list[int]) -> None:
        """The train state after step ``step`` (0-based), the ledger line and the replica check."""
        cfg = self.cfg
        faults.perturb(self.faults, self.ctx.rank, step + 1, self.model)
        self.state.step = step + 1
        self.state.next_packet = (step + 1) * self.topology.packets_per_step
        self.state.tokens_seen += int(sums.counters["tokens"])
        skipped = self.state.skipped
        for reason, counter in (("nonfinite_hidden", "nonfinite_samples"), ("target_oom", "oom_samples")):
            if sums.counters[counter]:
                skipped[reason] = skipped.get(reason, 0) + int(sums.counters[counter])
                self._check_dropped_samples(reason)
        if cfg.train.ledger:
            self._write_ledger(step + 1, trained)
        if cfg.train.check_replicas_every and self.state.step % cfg.train.check_replicas_every == 0:
            self.parallel.check(self.state.step)

    def _check_trained_on_something(self, step: int, weight_sum: float) -> None:
        """A step without a supervised slot trains nothing; ``EMPTY_STEPS_LIMIT`` in a row stop the run."""
        self._empty_steps = self._empty_steps + 1 if weight_sum == 0 else 0
        if self._empty_steps >= EMPTY_STEPS_LIMIT:
            first = step + 2 - self._empty_steps
            raise RuntimeError(
                f"steps {first}-{step + 1} trained on nothing: no packet held a supervised slot (every sample "
                f"dropped by the targets as non-finite, data/skipped/nonfinite_hidden="
                f"{self.state.skipped.get('nonfinite_hidden', 0)}, or loss masks without two consecutive "
                f"supervised tokens); check the target checkpoint and target.dtype, and the data's loss mask "
                f"(python -m dflash.data.prepare ... show=3)"
            )

    def _check_dropped_samples(self, reason: str) -> None:
        """Samples the targets dropped (``reason``: non-finite hidden states, or too large for the
        target's memory alone) count against ``data.max_skip_fraction`` of the samples this run
        trains: the run stops as soon as that share is certain to be exceeded."""
        dropped = self.state.skipped.get(reason, 0)
        planned = int(self.setup.plan.bounds[self.setup.num_steps * self.topology.packets_per_step])
        limit = self.cfg.data.max_skip_fraction * planned
        if dropped <= limit:
            return
        what, cause = {
            "nonfinite_hidden": (
                "with non-finite hidden states",
                f"a broken target checkpoint or an overflowing dtype (target.dtype={self.cfg.target.dtype}) is the usual cause",
            ),
            "target_oom": (
                "that alone did not fit the target's memory",
                f"lower data.max_length ({self.cfg.data.max_length}) or give the target more memory "
                "(topology.target_tp, a larger GPU)",
            ),
        }[reason]
        raise RuntimeError(
            f"the targets dropped {dropped} sample(s) {what}, more than data.max_skip_fraction="
            f"{self.cfg.data.max_skip_fraction} of the {planned} samples this run trains (data/skipped/{reason}); {cause}"
        )

    def _metrics(self, r: _StepReduced, t0: float, lrs: list[float], grad_norm: float) -> dict[str, float]:
        """Every metric of the step just taken (the same on every drafter)."""
        cfg, topo = self.cfg, self.topology
        m = step_metrics(
            r.sums,
            step=self.state.step,
            step_s=time.perf_counter() - t0,
            lr=lrs[0],
            grad_norm=grad_norm,
            loss_weights=coefficients(cfg.loss),
            num_targets=topo.num_targets,
            num_drafters=topo.num_drafters,
            self_produced=topo.self_produced,
        )
        m.update(group_lrs(self.optimizer, lrs))
        if cfg.train.time_phases:
            m.update({f"perf/phase/{name}_s": s for name, s in self.phases.seconds.items()})
        m["train/tokens_seen"] = float(self.state.tokens_seen)
        m["train/nonfinite_steps"] = float(self.state.nonfinite_steps)
        packets_in_step = max(topo.packets_per_step, 1)
        m["train/anchors_per_packet"] = float(r.sums.objective["num_blocks"]) / packets_in_step
        m["perf/target_s_per_packet"] = r.sums.counters["target_s"] / packets_in_step
        m["perf/drafter_s_per_packet"] = r.sums.counters["busy_s"] / packets_in_step
        m["perf/target_oom_splits"] = r.sums.counters["oom_splits"]
        if not topo.self_produced:  # the targets that made a packet of this step (no 0.0 for the others)
            for t in range(topo.num_targets):
                if r.target_packets[t] > 0:
                    m[f"perf/target_{t}/forward_s"] = float(r.target_fwd[t])
                    m[f"mem/peak_gib/rank_{topo.sender_ranks[t]}"] = float(r.target_mem[t])
        for d, rank in enumerate(topo.drafter_ranks):
            m[f"mem/peak_gib/rank_{rank}"] = float(r.drafter_mem[d])
        for reason, n in sorted(self.state.skipped.items()):
            m[f"data/skipped/{reason}"] = float(n)
        return m

    def _logged(self, step: int) -> bool:
        """Step ``step`` (1-based) is a row of W&B / metrics.jsonl (every drafter agrees)."""
        return step % self.cfg.train.log_every == 0 or step == self.setup.num_steps

    def _packet_shape(self, packet: Packet, anchors: PacketAnchors) -> PacketShape:
        """The packet as trained (its documents, real blocks, loss rows and the distinct positions
        their verifier rows are at; under a static shape the blocks computed: the chunks run times
        their padded size), for the cost model."""
        static = self.step_plan.static_shape
        size = self.step_plan.chunk_anchors(int(anchors.anchors.shape[1]))
        return PacketShape(
            tokens=packet.num_tokens,
            num_seqs=packet.num_seqs,
            num_anchors=anchors.num_blocks,
            loss_rows=anchors.num_rows,
            verifier_rows=anchors.verifier_rows,
            drafter_context_tokens=static[0] if static else None,
            drafter_blocks=len(anchors.chunks) * size if static else None,
        )

    def _costs(self, shape: PacketShape) -> PacketCosts:
        """The planner's cost model of one trained packet."""
        target_attn, _ = attention_kinds(self.cfg, shape.num_seqs)
        drafter_attn: AttentionKind = "sparse" if self.step_plan.attention == "flex" else "dense"
        return packet_costs(
            self.setup.meta,
            self.setup.arch,
            shape,
            self.cfg.loss,
            target_attention=target_attn,
            drafter_attention=drafter_attn,
        )

    @property
    def source_timeout(self) -> float:
        return self.cfg.topology.step_timeout_s if self.state.step > 0 else self.cfg.topology.init_timeout_s

    def _write_ledger(self, step: int, trained: list[int]) -> None:
        """Leader: one ledger line with every packet of the step (all drafters) and its samples."""
        per_drafter = gather_lists(self.ctx, trained)
        if not self.is_leader:
            return
        by_packet: dict[int, list[int]] = {}
        for flat in per_drafter:
            i = 0
            while i < len(flat):
                g, n = flat[i], flat[i + 1]
                by_packet[g] = flat[i + 2 : i + 2 + n]
                i += 2 + n
        order = sorted(by_packet)
        self.ledger.append(
            {"step": step, "packets": order, "sample_ids": [x for g in order for x in by_packet[g]]}
        )

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> None:
        """The leader writes the checkpoint; a sharded drafter's other drafters write their own
        shards into it meanwhile (nothing is gathered whole)."""
        if not self.cfg.train.save_weights:
            return
        state = self.parallel.checkpoint_state(self.optimizer)
        if not self.is_leader:
            state.join()
            return
        save_checkpoint(
            self.run_dir / "checkpoints",
            self.state.step,
            model_state=state.model_state,
            optimizer_state=state.optimizer_state,
            shards=state.shards,
            scheduler_state=self.scheduler.state_dict(),
            train_state=self.state,
            rng_state=capture_rng_state(),
            contract=self.setup.contract,
            config_yaml=OmegaConf.to_yaml(OmegaConf.structured(self.cfg), resolve=True),
            keep=self.cfg.train.keep_checkpoints,
        )

    def balance(self) -> str | None:
        """The leader's end-of-run line on where the time went (``summary.balance_line``)."""
        t = self.topology
        return balance_line(self.summary.rows, t.num_targets, t.num_drafters, t.self_produced, t.target_tp)

    # ---------------------------------------------------------------- main loop
    def _stopping(self) -> bool:
        """Stop after this step: agreed by every drafter (one drafter: its own signal counts at once)."""
        return self.stop_agreed or (self.topology.num_drafters == 1 and self.stop_requested)

    def _eval(self, step: int) -> dict[str, float]:
        """The periodic eval, every drafter on its share of the prompts within its time budget
        (``eval_budget_s``), with a progress bar on the leader; no metrics when a stop request
        aborted any share (a checkpoint never waits for an eval) or the budget allowed no decoding."""
        ev, evaluator = self.cfg.eval, self.evaluator
        assert evaluator is not None
        budget = eval_budget_s(ev.max_share, self.train_s, self.eval_s)
        log.info(
            "eval at step %d started: %d prompts x up to %d new tokens on this drafter%s",
            step,
            len(evaluator.prompts),
            ev.max_new_tokens,
            f", at most {budget:.1f} s (eval.max_share={ev.max_share:g} of {self.train_s:.0f} s trained"
            f"{f', less {self.eval_s:.0f} s of earlier evals' if self.eval_s else ''})"
            if ev.max_share is not None
            else "",
        )
        model = (
            self.parallel.whole()
        )  # a sharded forward is a collective; the drafters decode different prompts
        t0 = time.perf_counter()
        show = self.is_leader and self.cfg.logging.progress_bar
        with progress_bar(
            evaluator.planned_tokens, 0, show, desc=f"eval at step {step}", unit="tok", nested=True
        ) as bar:
            sums = evaluator.run(
                model,
                self.embed,
                self.head,
                should_stop=lambda: self.stop_requested,
                budget_s=budget,
                advance=bar.update if bar is not None else lambda n: None,
            )
        sums = all_reduce_sum(self.ctx, sums.to(self.device)).cpu()
        self.eval_s += time.perf_counter() - t0
        metrics = eval_metrics(sums, self.setup.arch.block_size)
        if sums[EVAL_SUMS.index("aborted")] > 0:
            log.warning("eval at step %d aborted: a stop was requested: checkpoint first", step)
            return {}
        if not metrics:
            log.warning(
                "eval at step %d skipped: its time budget is spent (eval.max_share=%g: the evals so far took "
                "%.0f s of %.0f s trained); raise eval.max_share, or evaluate the export with python -m dflash.eval",
                step,
                ev.max_share,
                self.eval_s,
                self.train_s,
            )
            return {}
        log.info(eval_line({"train/step": float(step), **metrics}))
        return metrics

    def _record(self, metrics: dict[str, float]) -> None:
        """Leader: W&B, metrics.jsonl, the summary figures and (for train rows) the rank-log line."""
        self.logger.log(metrics, int(metrics["train/step"]))
        self.metrics_log.append(jsonable(metrics))
        self.summary.add(metrics)
        if "train/loss" in metrics:
            log_to_files(logging.INFO, step_line(metrics, self.setup.num_steps))

    def run(self) -> int:
        """Train to the last step or to a stop; returns 0, or ``EXIT_STOPPED`` when a signal stopped
        the run early (``train.stop_after_steps`` is a requested stop: 0)."""
        cfg = self.cfg
        start = self.state.step
        agree_on_start(self.ctx, self.topology, self.state.next_packet, self.setup.num_steps)
        reset_peak_memory(self.device)
        end = self._end_step(start)
        discarded: int | None = None
        if start < end:
            self.source.prefetch(self.topology.packets_of_step(start, self.ctx.rank)[0])
        show_bar = self.is_leader and cfg.logging.progress_bar
        with progress_bar(self.setup.num_steps, start, show_bar) as bar:
            for step in range(start, end):
                t0 = time.perf_counter()
                metrics = self.train_step(step)
                self.train_s += time.perf_counter() - t0
                if step == start:  # loading and compiling are over: from now on a slow peer is a dead peer
                    self.source.set_timeout(cfg.topology.step_timeout_s)
                    set_timeout(self.ctx, cfg.topology.step_timeout_s)
                    self.source.first_step_done()  # the targets lower theirs once they hear of it
                done = self.state.step == self.setup.num_steps
                eval_due = self.state.step % cfg.eval.every == 0 or done if cfg.eval.every else False
                if self.evaluator is not None and eval_due and not self._stopping():
                    metrics.update(self._eval(self.state.step))
                if self.is_leader and (self.state.step % cfg.train.log_every == 0 or done):
                    self._record(metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{metrics['train/loss']:.3f}", tau_hat=f"{metrics['train/tau_hat']:.2f}"
                    )
                stop = self._stopping()
                asked = (
                    cfg.train.stop_after_steps is not None and self.state.step >= cfg.train.stop_after_steps
                )
                if done or stop or asked:
                    # the targets go first: they stop now instead of waiting out a slow final save
                    # and export (and timing out on slow storage)
                    discarded = self._stop_targets()
                if done or stop or asked or self.state.step % cfg.train.save_every == 0:
                    self.save()
                if (stop or asked) and not done:
                    log.warning(
                        "stopping at step %d of %d with a checkpoint (%s)",
                        self.state.step,
                        self.setup.num_steps,
                        self.stop_signal or "train.stop_after_steps",
                    )
                    break
        if discarded is None:  # no step ran in this launch
            discarded = self.source.stop_all()
        finished = self.state.step == self.setup.num_steps
        if finished and cfg.train.save_weights:
            whole = self.parallel.export_model(keep=self.is_leader)  # sharded: gathered on the leader
            if whole is not None:
                out = export_drafter(
                    whole, self.run_dir / "drafter", target_num_layers=self.setup.meta.num_layers
                )
                log.info("exported the drafter to %s", out)
        log.info(
            "drafter rank %d done at step %d (%d in-flight packets discarded)",
            self.ctx.rank,
            self.state.step,
            discarded,
        )
        stopped_early = not finished and self.stop_signal is not None
        if self.is_leader:
            self._print_summary(finished, stopped_early)
        return EXIT_STOPPED if stopped_early else 0

    def _stop_targets(self) -> int:
        """STOP to every target at a step boundary; returns the in-flight packets discarded. A target
        that died meanwhile (the SIGTERM that brought us here is often torchrun's, after a target
        crashed) fails the run, but a lone drafter first saves this step's checkpoint: its state is
        complete and the save needs no peer, so the restart resumes here rather than from the
        previous save (several drafters save together, so they do not try)."""
        try:
            return self.source.stop_all()
        except PeerError:
            if self.topology.num_drafters == 1:
                log.warning(
                    "a target died while stopping: saving the checkpoint of step %d first", self.state.step
                )
                self.save()
            raise

    def _end_step(self, start: int) -> int:
        """The step this launch trains up to: the last one, or none when the run already reached
        ``train.stop_after_steps`` (a relaunch of the command that stopped it)."""
        asked = self.cfg.train.stop_after_steps
        if asked is not None and asked <= start < self.setup.num_steps:
            log.warning(
                "the run is at step %d, already past train.stop_after_steps=%d: nothing to train; launch the "
                "same command without train.stop_after_steps (or with a larger value) to continue",
                start,
                asked,
            )
            return start
        return self.setup.num_steps

    def _print_summary(self, finished: bool, stopped_early: bool) -> None:
        asked = f"train.stop_after_steps={self.cfg.train.stop_after_steps}"
        by = self.stop_signal if stopped_early else (asked if not finished else None)
        table = summary_table(
            self.summary,
            run_dir=self.run_dir,
            status=status_line(self.state.step, self.setup.num_steps, by),
            drafter_dir=self.run_dir / "drafter" if finished and self.cfg.train.save_weights else None,
            checkpoint=latest_checkpoint(self.run_dir / "checkpoints"),
            wandb_mode=self.logger.mode,
            wandb_fallback=self.logger.fallback,
            extra={"balance": b} if (b := self.balance()) else None,
            cap=self.cfg.drafter.max_anchors_per_packet,
            not_exported="the run did not finish" if not finished else "train.save_weights=false",
        )
        log_to_files(logging.INFO, "\n" + table)
        print(table, flush=True)
        if self.summary.recent:  # the W&B run's summary: the same pooled figures beside the last step's
            self.logger.summary({f"{k}_recent": v for k, v in recent_figures(self.summary.recent).items()})
