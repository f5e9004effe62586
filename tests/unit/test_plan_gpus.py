"""GPUs for the planner (``dflash.plan.gpus``, ``dflash.plan.links``): the shipped profiles, PCIe
cards among them, a device name matched to its profile, field overrides, the link each transfer
takes, and a wrong name as one line."""

from __future__ import annotations

import re

import pytest
from testpaths import REPO

from dflash.cli import compose_config
from dflash.config import GpuFields, PlanConfig, register_configs
from dflash.plan.app import plan_config, run
from dflash.plan.gpus import (
    GPU_DIR,
    gpu_problems,
    load_gpu,
    match_profile,
    profiles,
    resolve_inputs,
    with_fields,
)
from dflash.plan.links import intranode_link, link_for
from dflash.plan.planner import make_plan
from dflash.plan.throughput import RoleTimes, disaggregated

PCIE = ("rtx_pro_6000", "l40s", "rtx_5090", "rtx_4090", "a100_pcie", "h100_pcie")


def _compose(overrides: list[str]):
    register_configs()
    return compose_config("plan_app", overrides)


def test_every_profile_cites_its_datasheet_and_describes_its_link():
    assert set(PCIE) <= set(profiles())
    for name in profiles():
        spec = load_gpu(name)
        header = "".join(
            line for line in (GPU_DIR / f"{name}.yaml").read_text().splitlines() if line.startswith("#")
        )
        assert re.search(r"TFLOPS|PFLOPS", header) and ("datasheet" in header or "whitepaper" in header), name
        assert (spec.nvlink_gbps > 0) != (spec.pcie_gbps > 0), name  # one intranode link, priced
        assert spec.match, name
    dense = {n: load_gpu(n).bf16_tflops for n in PCIE}
    assert dense == {
        "rtx_pro_6000": 503.8,
        "l40s": 362,
        "rtx_5090": 209.5,
        "rtx_4090": 165.2,
        "a100_pcie": 312,
        "h100_pcie": 756,
    }


@pytest.mark.parametrize(
    "device,profile",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100_pcie"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx_pro_6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx_pro_6000"),
        ("NVIDIA GeForce RTX 4090", "rtx_4090"),
        ("NVIDIA L40S", "l40s"),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_a_device_name_finds_its_profile_the_longest_match_first(device, profile):
    assert match_profile(device) == profile


def test_the_link_kind_prices_each_transfer():
    nv, pro, host = (intranode_link(load_gpu(n)) for n in ("h200", "rtx_pro_6000", "rtx_4090"))
    assert (nv.kind, nv.one_way_bytes_per_s) == ("NVLink", 450e9)
    assert (pro.kind, pro.one_way_bytes_per_s, pro.allreduce_bytes_per_s) == ("PCIe P2P", 45e9, 40e9)
    assert (host.kind, host.one_way_bytes_per_s) == ("PCIe via host memory", 12.5e9)  # two copies
    assert link_for(load_gpu("rtx_pro_6000"), 16).kind == "network"
    # a 1 GB packet between 1 target and 1 drafter on PCIe P2P: at most 45 packets/s
    times = RoleTimes(
        target_s=1e-6,
        drafter_s=1e-6,
        mfu_target=0.4,
        mfu_drafter=0.4,
        mfu_delta_rule=0.4,
        drafter_params=0,
        grad_accum_steps=1,
    )
    split = disaggregated(times, 10**9, load_gpu("rtx_pro_6000"), 2, 1, True)
    assert split.bound == "link" and split.packets_per_s == pytest.approx(45.0)


def test_fields_override_a_profile_and_bad_names_are_one_line(capsys):
    cfg = plan_config(
        _compose(["plan.gpu=rtx_pro_6000", "plan.gpu_spec.hbm_gb=141", "plan.gpu_spec.p2p=false"])
    )
    inputs = resolve_inputs(cfg)
    assert (inputs.gpu.hbm_gb, inputs.gpu.p2p, inputs.gpu.pcie_gbps) == (141, False, 45)
    assert with_fields(load_gpu("h200"), GpuFields()) == load_gpu("h200")
    (wrong,) = gpu_problems(PlanConfig(gpu="rtx6000"))
    assert "plan.gpu=rtx6000" in wrong and "rtx_pro_6000" in wrong and "\n" not in wrong
    (auto,) = gpu_problems(PlanConfig(gpu="auto"), cuda_available=False)
    assert "needs a CUDA device" in auto
    (unpriced,) = gpu_problems(PlanConfig(gpu="rtx_pro_6000", gpu_spec=GpuFields(pcie_gbps=0)))
    assert "pcie_gbps" in unpriced
    with pytest.raises(ValueError, match="plan.gpu=nope"):
        plan_config(_compose(["plan.gpu=nope"]))


def test_the_pcie_host_plan_names_its_link_and_the_shipped_experiment_is_its_recommendation(capsys):
    out = run(_compose(["experiment=qwen3_6_27b_rtx6000"]))
    text = capsys.readouterr().out
    assert "link   : PCIe P2P, 45 GB/s one way" in text and "Tensor-parallel replicas" in text
    assert out["link"] == "PCIe P2P" and out["link_packet_s"] > 0 and out["link_allreduce_s"] > 0
    cfg = plan_config(_compose(["experiment=qwen3_6_27b_rtx6000"]))
    plan = make_plan(cfg, resolve_inputs(cfg))
    assert plan.best.fits and plan.configured is plan.best
    assert (REPO / "conf" / "experiment" / "qwen3_6_27b_rtx6000.yaml").is_file()
