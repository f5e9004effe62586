#!/usr/bin/env bash
# Launch DFlash training on one 8-GPU host with the experiment's split (qwen3_8b_8gpu: GPUs 0-3 run the
# frozen target, GPUs 4-7 train the drafter; `python -m dflash.plan` recommends splits, see README).
#   scripts/launch_8gpu.sh data.path=/data/chat.jsonl [more Hydra overrides]
#   EXPERIMENT=qwen3_6_27b_8gpu scripts/launch_8gpu.sh data.path=/data/chat.jsonl
# Set WANDB_API_KEY in the environment for logging.mode=online (never put it in a config file).
set -euo pipefail
EXPERIMENT=${EXPERIMENT:-qwen3_8b_8gpu}
NGPU=${NGPU:-8}
# stdout from the drafter leader only (rank num_targets); every rank logs to its file
LEADER=$(python -m dflash.train experiment="$EXPERIMENT" "$@" --cfg job --package topology | awk '/^num_targets:/ {print $2}')
LOG_RANKS=${LOG_RANKS:-$LEADER}
export HYDRA_FULL_ERROR=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --standalone --nproc_per_node "$NGPU" --local-ranks-filter "$LOG_RANKS" \
  -m dflash.train experiment="$EXPERIMENT" "$@"
