"""Tensor-parallel target replicas on gloo: a target sharded over 2 real processes gives the hidden
states of the whole target (fp32, 1e-5), replicated on both ranks, for dense and MoE targets.

One world of 3 processes: ranks 0-1 form one replica (``new_replica_groups``), rank 2 stands where
a drafter would and loads the whole target as the reference (it is outside every replica, as a
drafter is). Every rank runs ``target_forward`` on the same batches and saves its outputs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from ranks import finish_rank, rank_env, run_ranks

pytestmark = pytest.mark.multiproc

WORLD = 3
TP = 2
VOCAB = 300
MODELS = ("qwen3", "qwen3_moe", "qwen3_5_moe", "gpt_oss")


def _lengths(pack: bool) -> list[int]:
    return [7, 12, 5] if pack else [9, 4]


def _batch(vocab: int, pack: bool):
    import torch

    from dflash.targets.forward import build_batch

    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in _lengths(pack)]
    return build_batch(seqs, pack=pack, pad_id=0)


def _forward_all(rank: int, tmp: str, models: list[dict]) -> dict:
    import torch

    from dflash.config import TargetConfig
    from dflash.distributed.process_group import new_replica_groups
    from dflash.targets.forward import target_forward
    from dflash.targets.loader import load_target
    from dflash.targets.tp import local_num_bytes

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    group = new_replica_groups(1, TP)  # ranks 0, 1; None on rank 2
    out: dict = {"local_bytes": {}, "types": {}, "times": {}}
    loaded = {}
    for m in models:
        t0 = time.perf_counter()
        attn = "eager" if m["name"] == "gpt_oss" else "sdpa"  # gpt-oss's attention sinks: no SDPA
        cfg = TargetConfig(name=m["name"], path=m["path"], dtype="float32", attn_implementation=attn)
        model = loaded[m["name"]] = load_target(cfg, torch.device("cpu"), torch.float32, tp_group=group)
        ids, mask, pos, _ = _batch(m["vocab"], m["pack"])
        aux, final = target_forward(model, ids, mask, m["layer_ids"], position_ids=pos)
        torch.save({"aux": aux, "final": final}, Path(tmp, f"{m['name']}_{rank}.pt"))
        out["local_bytes"][m["name"]] = local_num_bytes(model)
        out["types"][m["name"]] = [type(aux).__name__, type(final).__name__, list(aux.shape)]
        out["times"][m["name"]] = time.perf_counter() - t0
    torch.distributed.barrier()
    if rank < TP:
        out["peer_error"] = _kill_rank_1(rank, tmp, loaded["dense"], out)
    return out


def _kill_rank_1(rank: int, tmp: str, model, out: dict) -> str:
    """Rank 1 dies at decoder layer 1 of a forward; rank 0's failed all-reduce names its replica."""
    import torch

    from dflash.distributed.links import PeerError, replica_peer_errors
    from dflash.targets.forward import target_forward
    from dflash.targets.loader import decoder_layers

    if rank == 1:

        def die(*_args) -> None:
            Path(tmp, "rank1.json").write_text(json.dumps({**out, "rank": 1, "ok": True}))
            os._exit(9)

        decoder_layers(model)[1].register_forward_pre_hook(die)
    ids = torch.arange(16).unsqueeze(0)
    try:
        with replica_peer_errors("target 0 (rank 0)", ["target 0 (rank 0)", "target 0 (rank 1)"]):
            target_forward(model, ids, None, [1, 2], position_ids=ids)
    except PeerError as e:
        return str(e)
    return "no error"


def _entry(rank: int, world: int, tmp: str, models: list[dict]) -> None:
    def body() -> dict:
        rank_env(rank, world)
        return _forward_all(rank, tmp, models)

    finish_rank(rank, tmp, body)


def _save_variant(root: Path, model_type: str, num_experts: int, **extra) -> str:
    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import build_model

    spec = TinyTargetConfig(
        model_type=model_type,
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=num_experts,
        moe_intermediate_size=32,
        init_std=0.05,
        train_steps=0,
        **extra,
    )
    path = root / f"{model_type}_{num_experts}"
    build_model(spec, VOCAB, eos_token_id=1, pad_token_id=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random MoE targets without a tokenizer (the forward needs none): Qwen3-MoE with 5 experts
    (2 ranks cannot split 5 experts, so each expert's width is split), a hybrid Qwen3.5-MoE and gpt-oss."""
    root = tmp_path_factory.mktemp("tp_moe")
    return {
        "moe_width_split": _save_variant(root, "qwen3_moe", 5),
        "hybrid_moe": _save_variant(root, "qwen3_5_moe_text", 8),
        "gpt_oss": _save_variant(root, "gpt_oss", 8),
    }


def test_tp2_replica_equals_the_whole_target(tmp_path, tiny_target_dir, tiny_moe_target_dir, moe_variants):
    """Dense (packed), Qwen3-MoE with expert parallelism (packed), Qwen3-MoE with every expert's
    width split (packed), hybrid Qwen3.5-MoE (padded rows) and gpt-oss (EP, attention replicated)."""
    import torch

    from dflash.targets.tp import tp_layout

    fields = ("name", "path", "vocab", "hidden", "layer_ids", "pack")
    rows = [
        ("dense", str(tiny_target_dir), 2112, 128, [1, 2, 4], True),
        ("moe_ep", str(tiny_moe_target_dir), 2112, 64, [0, 1, 2], True),
        ("moe_width_split", moe_variants["moe_width_split"], VOCAB, 64, [0, 2], True),
        ("hybrid_moe", moe_variants["hybrid_moe"], VOCAB, 64, [0, 3], False),
        ("gpt_oss", moe_variants["gpt_oss"], VOCAB, 64, [0, 2], True),
    ]
    models = [dict(zip(fields, row, strict=True)) for row in rows]
    assert tp_layout("qwen3_moe", 8, TP).experts == "ep" and tp_layout("qwen3_moe", 5, TP).experts == "tp"
    res = run_ranks(tmp_path, _entry, WORLD, (models,), deadline_s=90.0)
    for r in range(WORLD):
        assert res[r].get("ok"), res[r].get("traceback") or res[r]
    for m in models:
        name = m["name"]
        ref = torch.load(tmp_path / f"{name}_2.pt")
        lens = _lengths(m["pack"])
        batch = [1, sum(lens)] if m["pack"] else [len(lens), max(lens)]
        assert res[2]["types"][name] == ["Tensor", "Tensor", [*batch, m["hidden"] * len(m["layer_ids"])]]
        shards = [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(TP)]
        for r, got in enumerate(shards):
            assert res[r]["types"][name] == res[2]["types"][name], (name, r)  # full, plain tensors
            for key in ("aux", "final"):
                err = (got[key] - ref[key]).abs().max().item()
                assert err <= 1e-5, f"{name} rank {r} {key}: max |TP2 - TP1| = {err}"
        # the replica's ranks hold the same residual stream, bit for bit (all-reduced)
        assert all(torch.equal(shards[0][k], shards[1][k]) for k in ("aux", "final")), name
        # each rank holds about half of the weights (norms, routers and gpt-oss attention stay whole)
        whole, part = res[2]["local_bytes"][name], res[0]["local_bytes"][name]
        assert part < 0.75 * whole, (name, part, whole)
    # a rank of the replica dies in a forward: the other names the replica, like any dead peer
    error = res[0]["peer_error"]
    assert (
        error.startswith("target 0 (rank 0): the tensor-parallel all-reduce") and "target 0 (rank 1)" in error
    )
    assert "dead or stuck" in error, error
