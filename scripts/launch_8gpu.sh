#!/usr/bin/env bash
# Launch DFlash training on one 8-GPU host: GPUs 0-6 run the frozen target, GPU 7 trains the drafter.
#   scripts/launch_8gpu.sh data.path=/data/chat.jsonl [more Hydra overrides]
#   EXPERIMENT=qwen3_6_27b_7x1 scripts/launch_8gpu.sh data.path=/data/chat.jsonl
# Set WANDB_API_KEY in the environment for logging.mode=online (never put it in a config file).
set -euo pipefail
EXPERIMENT=${EXPERIMENT:-qwen3_8b_7x1}
NGPU=${NGPU:-8}
LOG_RANKS=${LOG_RANKS:-$((NGPU - 1))}   # stdout from the drafter leader only; every rank logs to its file
export HYDRA_FULL_ERROR=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --standalone --nproc_per_node "$NGPU" --local-ranks-filter "$LOG_RANKS" \
  -m dflash.train experiment="$EXPERIMENT" "$@"
