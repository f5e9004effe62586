"""Host syncs per packet on the target (tests/host_syncs.py; the meta device stands for the GPU).

``PacketMaker.make`` runs the real tiny target (its weights on the meta device) and waits for the
device once: the per-sample finite flags, which decide the packet's size. The headless forward adds
transformers' own mask preparation (``transformers/masking_utils.py``), which reads the position ids
(a packed row: ``find_packed_sequence_indices``) or the padding mask (``_ignore_causal_mask_sdpa``)
on the host; the tests pin that nothing else syncs, so a change on either side is seen.
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


@pytest.fixture(scope="module")
def meta_target(base_setup):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_setup.target_path, dtype=torch.float32)
    return model.eval().requires_grad_(False).to(META)


def _maker(base_setup, model, *, pack: bool, nonfinite: list[int] | None = None):
    from dflash.train.packets import PacketMaker

    cfg = base_setup.cfg
    cfg = dataclasses.replace(
        cfg,
        target=dataclasses.replace(cfg.target, pack=pack),
        fault=dataclasses.replace(cfg.fault, nonfinite_sample_ids=list(nonfinite or [])),
    )
    return PacketMaker(cfg, base_setup, model, META)


@pytest.mark.parametrize("pack", [True, False])
def test_one_host_sync_per_packet(base_setup, meta_target, pack):
    maker = _maker(base_setup, meta_target, pack=pack)
    for g in range(3):
        with HostSyncs() as syncs:
            pkt = maker.make(g)
        ours = syncs.where("dflash/")
        assert [(s.kind, s.op) for s in ours] == [("device-to-host copy", "_to_copy.default")], syncs.events
        assert "packets.py" in ours[0].where and "_finite_per_sample" in ours[0].where
        forward = [s for s in syncs.events if s not in ours]
        assert forward and all(MASKING in s.where and s.kind == "scalar read" for s in forward), forward
        assert pkt.aux_hidden.device == META and pkt.num_tokens == sum(
            base_setup.dataset.sample(int(i))[0].numel() for i in base_setup.plan.packet(g)
        )
        assert pkt.aux_hidden.shape == (
            pkt.num_tokens,
            len(base_setup.layer_ids) * base_setup.meta.hidden_size,
        )


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
