"""The sizes and time budgets of the GPU check: one profile for a GPU run, one for the CPU dry run
(the same code runs both), and the constants every part shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
"""The checkout the check runs from: part kernels runs its ``tests/gpu``, part loss its ``scripts/bench_loss.py``."""
EXPERIMENT = "qwen3_8b_8gpu"
PARTS = (
    "kernels",
    "loss",
    "colocated",
    "hybrid",
    "split",
    "tp",
    "allreduce",
    "fsdp",
    "two_targets",
    "sigterm",
)


@dataclass(frozen=True)
class TrainPart:
    """A training part's launch: its ranks, topology overrides and the words the table uses."""

    nproc: int
    topology: tuple[str, ...]
    mode: str
    overrides: tuple[str, ...] = ()
    """What the part sets beyond its topology (the drafters' sharding, the replica check)."""
    drafters: int = 1
    """Drafter ranks: packets per optimizer step (the experiment accumulates none)."""


ONE_TO_ONE = ("topology.num_targets=1", "topology.num_drafters=1")
ONE_TO_TWO = ("topology.num_targets=1", "topology.num_drafters=2")
TRAIN_PARTS = {
    "colocated": TrainPart(1, ("topology=colocated",), "co-located, 1 rank"),
    "hybrid": TrainPart(1, ("topology=colocated",), "co-located hybrid target, 1 rank"),
    "split": TrainPart(2, ONE_TO_ONE, "1 target + 1 drafter"),
    "tp": TrainPart(
        3,
        ("topology.num_targets=1", "topology.target_tp=2", "topology.num_drafters=1"),
        "1 target replica of 2 ranks (TP) + 1 drafter",
    ),
    "allreduce": TrainPart(
        3,
        ONE_TO_TWO,
        "1 target + 2 drafters, bucketed all-reduce",
        ("drafter.shard=none", "train.check_replicas_every=2"),
        drafters=2,
    ),
    "fsdp": TrainPart(
        3,
        ONE_TO_TWO,
        "1 target + 2 drafters, FSDP2 (drafter.shard=full)",
        ("drafter.shard=full",),
        drafters=2,
    ),
    "two_targets": TrainPart(
        3, ("topology.num_targets=2", "topology.num_drafters=1"), "2 targets + 1 drafter"
    ),
    "sigterm": TrainPart(2, ONE_TO_ONE, "1 target + 1 drafter, SIGTERM then resume, W&B offline"),
}
"""Parts that are a torchrun training run (rank i on GPU i, one GPU per rank as NCCL needs: part
split needs 2 GPUs, parts tp, allreduce, fsdp and two_targets 3)."""
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


@dataclass(frozen=True)
class Profile:
    """Sizes and budgets of a GPU run or of the CPU dry run (the same code runs both)."""

    name: str
    target: str
    """conf/target/<target>.yaml: its ``shape:`` block becomes the random target's config.json."""
    max_position_embeddings: int
    overrides: tuple[str, ...]
    """Training overrides after the experiment's (the dry run shrinks it)."""
    prompt_tokens: int
    response_tokens: int
    steps: dict[str, int]
    warmup_steps: int
    """Steps left out of the steady-state figures (step 1 compiles flex_attention)."""
    probe_docs: int
    """Documents in the probe's packet (token budget / docs tokens each)."""
    bench: tuple[str, ...]
    budgets: dict[str, float]
    """Seconds per step of the check: kernels, loss, setup (in-process), target_probe and every
    training part."""
    inline_probe: bool
    """Run the target probe in this process (the dry run: one interpreter start less)."""
    hybrid_shape: dict[str, Any]
    """Part hybrid's target (``TargetShape`` fields, a Qwen3.5/3.6-style ``qwen3_5_text``: Gated
    DeltaNet layers with a full-attention layer every 4th), built with random weights like the main one."""
    hybrid_layer_ids: tuple[int, ...]
    """Part hybrid's taps."""
    sigterm_at_step: int
    """Part sigterm: the signal goes to torchrun once the ledger holds this step (after the compile);
    the run has ``steps["sigterm"]`` steps and the relaunch trains the rest."""


GPU = Profile(
    name="gpu",
    target="qwen3_8b",
    max_position_embeddings=40960,
    overrides=(),
    prompt_tokens=290,  # + 700 + the chat template: 16 samples of ~1000 tokens fill a 16,384 budget
    response_tokens=700,
    steps={
        "colocated": 30,
        "hybrid": 12,
        "split": 20,
        "tp": 20,
        "allreduce": 10,
        "fsdp": 10,
        "two_targets": 10,
        "sigterm": 10,
    },
    warmup_steps=5,
    probe_docs=16,
    bench=(
        *("--device", "cuda", "--dtype", "bf16"),
        *("--rows", "32768", "--hidden", "4096", "--vocab", "151936"),
        *("--chunks", "2048,8192", "--repeats", "3", "--warmup", "1"),
    ),
    # One H200: 90 + 110 + 30 + 45 + 200 + hybrid 120 = 595 s, + ~5 s of this script's own start and
    # end: 10 minutes. With 2+ GPUs split (200) and sigterm (300) add 500 s; with 3+ tp (200), allreduce,
    # fsdp and two_targets (180 each) 740 s more: 31 minutes in all at most.
    budgets={
        "kernels": 90,
        "loss": 110,
        "setup": 30,
        "target_probe": 45,
        "colocated": 200,
        "hybrid": 120,
        "split": 200,
        "tp": 200,
        "allreduce": 180,
        "fsdp": 180,
        "two_targets": 180,
        "sigterm": 300,
    },
    inline_probe=False,
    # Qwen3.6's layer at a small width: 6 Gated DeltaNet layers (8 key / 16 value heads of 128) and 2
    # full-attention ones (8 / 2 heads of 256 with the output gate), Qwen3.6's vocabulary.
    hybrid_shape={
        "model_type": "qwen3_5_text",
        "num_layers": 8,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 256,
        "vocab_size": 248320,
        "attn_output_gate": True,
        "num_linear_layers": 6,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    hybrid_layer_ids=(1, 2, 3, 4, 5),
    sigterm_at_step=3,
)
DRY = Profile(
    name="dry-run",
    target="tiny",
    max_position_embeddings=4096,
    overrides=(
        "target.layer_ids=[1,2,4]",
        "target.dtype=float32",
        "drafter.mask_token_id=null",
        "drafter.num_anchors=8",
        "drafter.max_anchors_per_packet=64",
        "data.max_length=160",
        "data.token_budget=640",
        "topology.device=cpu",
        "topology.backend=gloo",
        "topology.init_timeout_s=120",
        "topology.step_timeout_s=60",
    ),
    prompt_tokens=40,
    response_tokens=100,
    steps={
        "colocated": 4,
        "hybrid": 4,
        "split": 4,
        "tp": 4,
        "allreduce": 4,
        "fsdp": 4,
        "two_targets": 4,
        "sigterm": 8,
    },
    warmup_steps=1,
    probe_docs=4,
    bench=(
        *("--device", "cpu", "--dtype", "fp32", "--threads", "1", "--inline"),
        *("--rows", "256", "--hidden", "32", "--vocab", "2048"),
        *("--chunks", "64,256", "--repeats", "1", "--warmup", "0"),
    ),
    budgets={
        "kernels": 120,
        "loss": 120,
        "setup": 120,
        "target_probe": 120,
        "colocated": 240,
        "hybrid": 240,
        "split": 240,
        "tp": 240,
        "allreduce": 240,
        "fsdp": 240,
        "two_targets": 240,
        "sigterm": 300,
    },
    inline_probe=True,
    hybrid_shape={
        "model_type": "qwen3_5_text",
        "num_layers": 8,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 2112,
        "attn_output_gate": True,
        "num_linear_layers": 6,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
    hybrid_layer_ids=(1, 3, 5),
    sigterm_at_step=2,
)
