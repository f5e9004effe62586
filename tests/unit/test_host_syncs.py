"""Host syncs per packet on the target (tests/host_syncs.py; the meta device stands for the GPU).

``PacketMaker.make`` runs the real tiny target (its weights on the meta device) and waits for the
device once: the per-sample finite flags, which decide the packet's size. The headless forward adds
none: the attention masks come from the samples' lengths (``dflash.targets.attention``), so
transformers' mask preparation never reads the position ids (``find_packed_sequence_indices``) or
the padding mask (``_ignore_causal_mask_sdpa``) on the host, as it does when given only tensors.
flex_attention and flash-attn kernels do not run on the meta device: their mask preparation is
counted alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from host_syncs import HostSyncs

META = torch.device("meta")
MASKING = "transformers/masking_utils.py"


@pytest.fixture(scope="module")
def base_setup(run_cache):
    from runner import prepare_fast

    return prepare_fast(run_cache)


def _meta_target(base_setup, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        base_setup.target_path, dtype=torch.float32, attn_implementation=attn
    )
    return model.eval().requires_grad_(False).to(META)


@pytest.fixture(scope="module")
def meta_target(base_setup):
    return _meta_target(base_setup, "sdpa")


def _maker(base_setup, model, *, pack: bool, nonfinite: list[int] | None = None):
    from dflash.train.packets import PacketMaker

    cfg = base_setup.cfg
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, pack=pack))
    maker = PacketMaker(cfg, base_setup, model, META)
    maker.nonfinite_sample_ids = set(nonfinite or [])  # what DFLASH_FAULTS would inject
    return maker


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("pack", [True, False])
def test_one_host_sync_per_packet(base_setup, meta_target, pack, attn):
    model = meta_target if attn == "sdpa" else _meta_target(base_setup, attn)
    maker = _maker(base_setup, model, pack=pack)
    docs = []
    for g in range(3):
        with HostSyncs() as syncs:
            pkt = maker.make(g)
        assert [(s.kind, s.op) for s in syncs.events] == [("device-to-host copy", "_to_copy.default")], (
            syncs.events
        )
        assert "packets.py" in syncs.events[0].where and "_finite_per_sample" in syncs.events[0].where
        assert pkt.aux_hidden.device == META and pkt.num_tokens == sum(
            base_setup.dataset.sample(int(i))[0].numel() for i in base_setup.plan.packet(g)
        )
        assert pkt.aux_hidden.shape == (
            pkt.num_tokens,
            len(base_setup.layer_ids) * base_setup.meta.hidden_size,
        )
        docs.append(pkt.num_seqs)
    assert max(docs) > 1, docs  # packed rows of several documents: the masks were made, not skipped


def test_transformers_alone_would_read_the_tensors(base_setup, meta_target):
    """Without the documents' lengths transformers prepares the masks from the tensors and reads them
    on the host (once per forward): what ``seq_lens`` saves, and proof that the counter sees it."""
    from dflash.targets.forward import build_batch, target_forward

    seqs = [base_setup.dataset.sample(int(i))[0] for i in base_setup.plan.packet(0)]
    for pack in (True, False):
        ids, attn, pos, _ = (
            None if t is None else t.to(META) for t in build_batch(seqs, pack=pack, pad_id=0)
        )
        with HostSyncs() as syncs:
            target_forward(meta_target, ids, attn, base_setup.layer_ids, position_ids=pos)
        assert syncs.events and all(MASKING in s.where and s.kind == "scalar read" for s in syncs.events), (
            pack,
            syncs.events,
        )


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2", "sdpa"])
@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gpt_oss"])
def test_document_masks_are_made_without_reading_the_device(attn, model_type):
    """The masks (or flash-attn's boundaries) of a packed row of three documents, per layer type
    where the config lists them, with no host sync; a single-mask model (Llama) under flash-attn
    keeps the position ids, which transformers then reads once."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import AutoConfig

    from dflash.targets.attention import document_inputs

    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
    config = AutoConfig.for_model(
        model_type, num_hidden_layers=2, **(extra if model_type == "gpt_oss" else {})
    )
    config._attn_implementation = attn
    lens = [300, 200, 12]
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(META)
    ids = torch.zeros(1, sum(lens), dtype=torch.long, device=META)
    with HostSyncs() as syncs:
        out = document_inputs(config, lens, ids, None, pos, torch.float32)
    assert out is not None and syncs.events == [], syncs.events
    masks = out["attention_mask"]
    if model_type == "llama":
        assert not isinstance(masks, dict)
        masks = {"full_attention": masks}
    else:
        assert set(masks) == set(config.layer_types)
    for mask in masks.values():
        if attn == "flex_attention":
            assert isinstance(mask, BlockMask) and mask.shape == (1, 1, sum(lens), sum(lens))
        elif attn == "sdpa":
            assert mask.dtype == torch.bool and mask.shape == (1, 1, sum(lens), sum(lens))
        else:
            assert mask is None
    if attn == "flash_attention_2":
        assert (out["max_length_q"], out["cu_seq_lens_q"].shape) == (300, (4,))
    assert out["position_ids"] is pos


def test_dropped_samples_cost_no_extra_sync(base_setup, meta_target):
    """A packet with a non-finite sample: dropping it is host work and device gathers (no mask index)."""
    g = 0
    ids = base_setup.dataset.sample_ids[base_setup.plan.packet(g)].tolist()
    maker = _maker(base_setup, meta_target, pack=True, nonfinite=[ids[0]])
    n = len(ids)
    with HostSyncs(
        fill=lambda shape, dtype: torch.tensor([False] + [True] * (n - 1))[: shape[0]].to(dtype)
    ) as syncs:
        pkt = maker.make(g)
    assert pkt.num_skipped_nonfinite == 1 and pkt.num_seqs == n - 1
    assert len(syncs.where("dflash/")) == 1, syncs.events


def test_counter_sees_every_kind_of_sync():
    x = torch.ones(4, device=META)
    with HostSyncs() as syncs:
        bool(x.sum() > 0)
        x.cpu()
        torch.ones(2).to(META)
        torch.ones(2).to(META, non_blocking=True)  # not a sync
        torch.ones(3).sum().item()  # host tensor: not a sync
    assert [s.kind for s in syncs.events] == [
        "scalar read",
        "device-to-host copy",
        "blocking host-to-device copy",
    ]
    assert all("test_host_syncs.py" in s.where for s in syncs.events)


# ---------------------------------------------------------------- the drafter side


class _Delivered:
    """The packets as a ``DrafterLink`` hands them over: its payload on the device, nothing read
    yet (``host`` unset). The real link cannot run on the meta device; its own reads are the header
    (``decode_header``, one copy of 16 ints, before any payload is posted) and ``host_fields``."""

    last_wait_s = 0.0

    def __init__(self, packets: dict[int, object]) -> None:
        self.packets = packets

    def recv(self, g: int):
        return self.packets[g]

    def ack(self, g: int) -> None:
        pass

    def prefetch(self, g: int) -> None:
        pass


def _meta_trainer(base_setup, meta_target, source):
    """A ``DrafterTrainer`` of the fast run on the meta device, made without its process group:
    its real model, embedding and lm_head (meta), packet source ``source``, one drafter."""
    from types import SimpleNamespace

    from dflash.distributed.drafter_parallel import Replicated
    from dflash.drafter.model import DFlashDraftModel
    from dflash.drafter.step import StepPlan
    from dflash.metrics import PhaseTimer
    from dflash.targets.loader import target_embed_and_head
    from dflash.train.faults import FaultConfig
    from dflash.train.trainer import DrafterTrainer

    trainer = DrafterTrainer.__new__(DrafterTrainer)
    trainer.cfg, trainer.setup, trainer.topology = base_setup.cfg, base_setup, base_setup.topology
    trainer.ctx = SimpleNamespace(rank=base_setup.topology.drafter_ranks[0])
    trainer.device, trainer.source = META, source
    model = DFlashDraftModel(base_setup.arch)
    model.reset_parameters(seed=0)
    trainer.model = model.to(META)
    trainer.parallel = Replicated(trainer.model, trainer.ctx, 1)
    trainer.embed, trainer.head = (t.detach() for t in target_embed_and_head(meta_target))
    trainer.step_plan = StepPlan.for_training(
        base_setup.cfg, base_setup.arch.block_size, device="cpu", token_budget=base_setup.data.token_budget
    )
    trainer.phases = PhaseTimer(META, sync=False)
    trainer.faults = FaultConfig()
    return trainer


def _host_flat(packet) -> torch.Tensor:
    """What ``host_fields`` reads back from the device: [seq_lens, sample_ids, loss_mask] as int64."""
    h = packet.host
    return torch.cat([h.seq_lens, h.sample_ids, h.loss_mask.long()])


def test_drafter_packets_cost_one_host_sync(base_setup, meta_target):
    """Every packet of a drafter step, through ``DrafterTrainer._accumulate`` (``_count_packet``,
    ``_forward_packet``: anchors, blocks, masks, the drafter, the chunked verifier loss on its CUDA
    branches, the backward, ``StepSums``): one host sync per packet, ``host_fields``' copy of the
    small payload fields, which also feeds ``validate_payload`` (host work).

    Why one: the anchors are drawn on the host (a CPU generator) from the host copies, so the host
    also knows the positions, the anchors and the supervised row count R, and hands them to the
    device (non-blocking copies; ``nonzero_static`` with R); the loss's checks are asserted on the
    device (``torch._assert_async``); the step's sums and the non-finite loss count stay on the
    device until the step's all-reduce. With the link's header read that is 2 per packet on a
    drafter rank (goal: <= 2); a co-located rank's packets carry their host copies: 0 on the
    drafter side (the target's own 1 is ``test_one_host_sync_per_packet``). Per step, after the
    packets: the all-reduces' reads in ``_reduce`` and the gradient norm (not counted here).
    """
    import dataclasses

    from dflash.loss.device import as_cuda
    from dflash.train.packets import LocalPackets, PacketMaker

    colocated = LocalPackets(PacketMaker(base_setup.cfg, base_setup, meta_target, META, own_peak=False))
    trainer = _meta_trainer(base_setup, meta_target, None)
    steps = range(3)
    per_step = [trainer.topology.packets_of_step(step, trainer.ctx.rank) for step in steps]
    with HostSyncs():  # the target's work (test_one_host_sync_per_packet)
        made = {g: colocated.recv(g) for packets in per_step for g in packets}
    trainer.source = _Delivered({g: dataclasses.replace(p, host=None) for g, p in made.items()})
    for step, packets in zip(steps, per_step, strict=True):
        reads = iter([_host_flat(made[g]) for g in packets])
        with as_cuda(), HostSyncs(fill=lambda shape, dtype, reads=reads: next(reads).to(dtype)) as syncs:
            local = trainer._accumulate(step)
        assert [(s.kind, s.op) for s in syncs.events] == [("device-to-host copy", "_to_copy.default")] * len(
            packets
        ), syncs.events
        assert all("protocol.py" in s.where and "host_fields" in s.where for s in syncs.events), syncs.events
        assert local.sums.objective["loss_sum"].device == META and local.sums.nonfinite_loss.device == META
        ids = [x for g in packets for x in made[g].host.sample_ids.tolist()]
        assert local.trained == [
            x for g in packets for x in [g, made[g].num_seqs, *made[g].host.sample_ids.tolist()]
        ]
        assert len(ids) > 1 and local.anchors_offered > 0
        assert len(local.shapes) == len(packets) and all(s.loss_rows > 0 for s in local.shapes)

    trainer.source = _Delivered(made)  # co-located: the packets carry the target's host copies
    with as_cuda(), HostSyncs() as syncs:
        trainer._accumulate(0)
    assert syncs.events == [], syncs.events
