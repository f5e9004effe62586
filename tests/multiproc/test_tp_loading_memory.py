"""Loading a tensor-parallel replica: each rank's private host memory grows by its shard, not by the model.

One world of 3 processes loads a target of ~67M parameters saved in bf16 as fp32 (270 MB), so that
every loaded tensor is a copy in private memory (as a host copy before moving to a GPU would be):
ranks 0-1 as one TP=2 replica, rank 2 whole (the contrast: it must show the full model, or the
measurement could not see a full copy). The test samples every child's ``/proc/<pid>/status`` from
outside about every millisecond while they load: ``RssAnon`` is the process's private memory;
``RssFile`` counts file pages mapped into the process: the memory-mapped safetensors file (page
cache, shared by every rank of a host, reclaimable) but also libraries and readahead around every
fault, so it is printed (``-s``), not asserted. (A rank reads only its rows of the column-split
weights, but a column slice of a row-split weight, o_proj or down_proj, touches every page of it.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ranks import finish_rank, rank_env, run_ranks

pytestmark = pytest.mark.multiproc

WORLD = 3
TP = 2
MIB = 2**20
OVERHEAD_MIB = 64
"""Allowance beyond the shard for what loading itself allocates (plans, per-tensor temporaries)."""
IMPORTED_FIRST = ("torch", "torch.distributed.tensor", "transformers.modeling_utils", "dflash.targets.loader")


def _status(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of ``pid`` in bytes (empty once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _load(rank: int, tmp: str, path: str) -> dict:
    import importlib

    import torch

    # imported before the baseline (whatever the fork server imported already): only the loading
    # itself may count
    for module in IMPORTED_FIRST + (
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.distributed.mixin",
    ):
        importlib.import_module(module)

    from dflash.config import TargetConfig
    from dflash.distributed.process_group import new_replica_groups
    from dflash.targets.loader import load_target
    from dflash.targets.tp import local_num_bytes

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    group = new_replica_groups(1, TP)
    torch.distributed.barrier()
    before = _status_self()
    Path(tmp, f"start{rank}").write_text(str(before))  # the parent's samples count from here
    model = load_target(
        TargetConfig(name="big", path=path, dtype="float32"), torch.device("cpu"), torch.float32, group
    )
    result = {"before": before, "local_bytes": local_num_bytes(model)}
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return result


def _status_self() -> dict[str, int]:
    import os

    return _status(os.getpid())


def _entry(rank: int, world: int, tmp: str, path: str) -> None:
    def body() -> dict:
        rank_env(rank, world)
        return _load(rank, tmp, path)

    finish_rank(rank, tmp, body)


@pytest.fixture(scope="module")
def big_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A dense Qwen3 of ~67M parameters saved in bf16 (zeros: only the sizes matter here) and its
    size in fp32 bytes; the tensors are named and shaped by the model built on the meta device."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    path = tmp_path_factory.mktemp("big_target")
    cfg.save_pretrained(path)
    save_file(
        {k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in shapes.items()},
        path / "model.safetensors",
    )
    return str(path), 4 * sum(s.numel() for s in shapes.values())


def test_a_tp_rank_holds_its_shard_while_loading(tmp_path, big_target):
    path, full_bytes = big_target
    peaks: dict[int, dict[str, int]] = {}

    def sample(procs) -> None:
        for r, p in enumerate(procs):
            if p.pid is None or not Path(tmp_path, f"start{r}").exists():
                continue
            now = _status(p.pid)
            peak = peaks.setdefault(r, {})
            for key, value in now.items():
                peak[key] = max(peak.get(key, 0), value)

    t0 = time.perf_counter()
    res = run_ranks(tmp_path, _entry, WORLD, (path,), deadline_s=90.0, poll=sample)
    for r in range(WORLD):
        assert res[r].get("ok"), res[r].get("traceback") or res[r]
    growth = {r: peaks[r]["RssAnon"] - res[r]["before"]["RssAnon"] for r in range(WORLD)}
    cached = {r: peaks[r]["RssFile"] - res[r]["before"]["RssFile"] for r in range(WORLD)}
    print(
        f"load {time.perf_counter() - t0:.1f}s, MiB: private growth", {r: g // MIB for r, g in growth.items()}
    )
    print("  file pages", {r: c // MIB for r, c in cached.items()}, f"of a {full_bytes // 2 // MIB} MiB file")
    shard = res[0]["local_bytes"]
    assert shard < 0.6 * full_bytes and res[2]["local_bytes"] == full_bytes
    assert growth[2] >= 0.9 * full_bytes, (growth, full_bytes)  # a whole load shows the whole model
    for r in range(TP):
        assert growth[r] <= shard + OVERHEAD_MIB * MIB, (
            f"rank {r}: private memory grew {growth[r] / MIB:.0f} MiB while loading a {shard / MIB:.0f} MiB "
            f"shard of a {full_bytes / MIB:.0f} MiB target"
        )
