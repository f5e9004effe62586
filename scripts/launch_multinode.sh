#!/usr/bin/env bash
# Launch one node's share of a multi-node DFlash run (torchrun, c10d rendezvous). Run the same
# command on every node, with that node's NODE_RANK:
#   NNODES=2 NODE_RANK=0 ENDPOINT=node0:29500 RUN_DIR=/shared/runs/qwen3_8b \
#     scripts/launch_multinode.sh experiment=qwen3_8b_8gpu data.path=/shared/data/chat.jsonl
#
# RUN_DIR must be on a filesystem every node sees (checkpoints, ledger, exported drafter; a torchrun
# restart may put the drafter leader on another node): the run refuses to start when a rank cannot
# see it. RUN_ID (default: the SLURM job id, else RUN_DIR's name) is torchrun's --rdzv-id: the same
# on every node of one launch. MAX_RESTARTS restarts every node's workers after a failure.
# NPROC (default 8) is the number of processes (GPUs) per node; OMP_NUM_THREADS (default: this
# node's cores divided by NPROC) the CPU threads of each.
# Ranks: node 0 gets ranks 0..NPROC-1, node 1 the next NPROC, ...; targets are ranks
# 0..num_targets-1, drafters the last ones (docs/training.md, "On several hosts").
set -euo pipefail
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${ENDPOINT:?set ENDPOINT (host:port of node 0, the rendezvous)}"
: "${RUN_DIR:?set RUN_DIR (a directory on a filesystem shared by every node)}"
NPROC=${NPROC:-8}
RUN_ID=${RUN_ID:-${SLURM_JOB_ID:-$(basename "$RUN_DIR")}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" --rdzv-id "$RUN_ID" --max-restarts "$MAX_RESTARTS" \
  -m dflash.train hydra.run.dir="$RUN_DIR" "$@"
