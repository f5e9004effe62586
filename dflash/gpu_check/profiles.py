"""The sizes and time budgets of the GPU check: one profile for a GPU run, one for the CPU dry run
(the same code runs both), and the constants every part shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout the check runs from: part kernels runs its ``tests/gpu``, part loss its ``scripts/bench_loss.py``."""
EXPERIMENT = "qwen3_8b_8gpu"
PARTS = ("kernels", "loss", "colocated", "split", "tp")


@dataclass(frozen=True)
class TrainPart:
    """A training part's launch: its ranks, topology overrides and the words the table uses."""

    nproc: int
    topology: tuple[str, ...]
    mode: str


TRAIN_PARTS = {
    "colocated": TrainPart(1, ("topology=colocated",), "co-located, 1 rank"),
    "split": TrainPart(2, ("topology.num_targets=1", "topology.num_drafters=1"), "1 target + 1 drafter"),
    "tp": TrainPart(
        3,
        ("topology.num_targets=1", "topology.target_tp=2", "topology.num_drafters=1"),
        "1 target replica of 2 ranks (TP) + 1 drafter",
    ),
}
"""Parts that are a torchrun training run (rank i on GPU i: part split needs 2 GPUs, part tp 3)."""
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
    """Seconds per step of the check: kernels, loss, setup (in-process), target_probe, colocated, split, tp."""
    inline_probe: bool
    """Run the target probe in this process (the dry run: one interpreter start less)."""


GPU = Profile(
    name="gpu",
    target="qwen3_8b",
    max_position_embeddings=40960,
    overrides=(),
    prompt_tokens=290,  # + 700 + the chat template: 16 samples of ~1000 tokens fill a 16,384 budget
    response_tokens=700,
    steps={"colocated": 30, "split": 20, "tp": 20},
    warmup_steps=5,
    probe_docs=16,
    bench=(
        *("--device", "cuda", "--dtype", "bf16"),
        *("--rows", "32768", "--hidden", "4096", "--vocab", "151936"),
        *("--chunks", "2048,8192", "--repeats", "3", "--warmup", "1"),
    ),
    # One H200: 90 + 110 + 30 + 45 + 200 = 475 s, + ~5 s of this script's own start and end: 8 minutes.
    # split (2+ GPUs only) and tp (3+ GPUs only) add their own 200 s each.
    budgets={
        "kernels": 90,
        "loss": 110,
        "setup": 30,
        "target_probe": 45,
        "colocated": 200,
        "split": 200,
        "tp": 200,
    },
    inline_probe=False,
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
    steps={"colocated": 4, "split": 4, "tp": 4},
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
        "split": 240,
        "tp": 240,
    },
    inline_probe=True,
)
