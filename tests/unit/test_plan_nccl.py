"""NCCL's buffers in the plan (issue 30, item 5): estimated per rank from the split and the link
(dflash.plan.nccl), printed beside the memory table and in the JSON line, and a warning when they
and the CUDA context do not fit ``plan.reserved_gib``."""

from __future__ import annotations

import json

import pytest

from dflash.config import GpuSpec
from dflash.plan.app import run
from dflash.plan.links import intranode_link
from dflash.plan.nccl import MIB, nccl_bytes, nccl_gib_per_role

NVLINK = intranode_link(GpuSpec(name="x", hbm_gb=80, bf16_tflops=1, nvlink_gbps=900))
PCIE = intranode_link(GpuSpec(name="y", hbm_gb=48, bf16_tflops=1, pcie_gbps=25, p2p=True))


def test_buffers_by_hand():
    # a ring of 2 connections x 32 channels x 10 MiB, and 2 peers x 2 directions x 32 channels x 2 MiB
    assert nccl_bytes(NVLINK, collectives=1, p2p_peers=2) == (2 * 32 * 10 + 2 * 2 * 32 * 2) * MIB
    assert nccl_bytes(PCIE, collectives=1, p2p_peers=2) == (2 * 4 * 10 + 2 * 2 * 4 * 2) * MIB


def test_each_role_counts_its_communicators_and_peers():
    one = nccl_gib_per_role(NVLINK, num_targets=7, num_drafters=1, target_tp=1, colocated=False)
    many = nccl_gib_per_role(NVLINK, num_targets=1, num_drafters=7, target_tp=1, colocated=False)
    assert many["target"] > one["target"]  # a target feeding 7 drafters holds 7 peers' buffers
    assert one["drafter"] > many["drafter"] - nccl_bytes(NVLINK, collectives=1, p2p_peers=0) / 2**30
    tp = nccl_gib_per_role(NVLINK, num_targets=3, num_drafters=2, target_tp=2, colocated=False)
    assert tp["target"] == pytest.approx(nccl_bytes(NVLINK, collectives=2, p2p_peers=2) / 2**30)
    assert (
        nccl_gib_per_role(PCIE, num_targets=7, num_drafters=1, target_tp=1, colocated=False)["drafter"]
        < (one["drafter"])
    )
    assert nccl_gib_per_role(NVLINK, num_targets=1, num_drafters=1, target_tp=1, colocated=True) == {
        "colocated": 0
    }


def test_the_plan_prints_them_and_warns_when_the_reserve_is_short(capsys):
    from dflash.cli import compose_config
    from dflash.config import register_configs

    register_configs()
    base = ["experiment=qwen3_6_27b_7x1", "plan.world_size=8", "plan.gpu=h200"]
    out = run(compose_config("plan_app", base))
    text = capsys.readouterr().out
    assert "NCCL buffers, estimated for 7:1 over NVLink" in text
    assert (
        set(out["nccl_gib"]) == {"target", "drafter"}
        and json.loads(text.strip().splitlines()[-1])["nccl_gib"]
    )
    assert not any("NCCL buffers" in w for w in out["warnings"])
    short = run(compose_config("plan_app", [*base, "plan.reserved_gib=1"]))
    assert any("plan.reserved_gib=1" in w and "NCCL buffers" in w for w in short["warnings"]), short[
        "warnings"
    ]
