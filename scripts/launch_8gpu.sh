#!/usr/bin/env bash
# Launch DFlash training on one 8-GPU host with the experiment's split (qwen3_8b_8gpu: GPUs 0-1 run the
# frozen target, GPUs 2-7 train the drafter at the recipe's 512 anchors per sample; `python -m dflash.plan`
# recommends the split, packet size and levers for your GPUs, see docs/planner.md).
#   scripts/launch_8gpu.sh data.path=/data/chat.jsonl [more Hydra overrides]
#   EXPERIMENT=qwen3_6_27b_8gpu scripts/launch_8gpu.sh data.path=/data/chat.jsonl
# Set WANDB_API_KEY in the environment for logging.mode=online (never put it in a config file).
# The console shows rank 0 (setup, data) and the drafter leader (progress bar, summary); every rank
# writes its full log to <run dir>/rank<r>.log.
set -euo pipefail
EXPERIMENT=${EXPERIMENT:-qwen3_8b_8gpu}
NGPU=${NGPU:-8}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --standalone --nproc_per_node "$NGPU" -m dflash.train experiment="$EXPERIMENT" "$@"
