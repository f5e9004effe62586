"""GPU readiness check: one command that proves the product on a GPU host and says how fast it is.

    make gpu-check                                        # = python scripts/gpu_check.py --out gpu_check.json
    python scripts/gpu_check.py --out /tmp/gpu_check.json # the GPU is detected (--gpu h200 overrides)
    python scripts/gpu_check.py --dry-run                 # every part on CPU at tiny sizes, fp32 (CI runs it)
    python scripts/gpu_check.py --parts loss,colocated    # a subset (e.g. to rerun what failed)

Parts, each run as a subprocess with its own time budget (printed up front and enforced: a hang or a
crash in one part is reported and the other parts still run; time a part leaves unused goes to the
next ones; on one H200 the budgets add up to 10 minutes, on 8 GPUs to 31 at most):

kernels. ``pytest -m gpu tests/gpu``: the CUDA tests (chunked loss fp32/bf16/compiled, compiled flex_attention
   against dense SDPA, hybrid targets' linear attention) and their pass/fail/skip counts. On CPU all of
   them skip: reported, not a failure.
loss. ``scripts/bench_loss.py --device cuda --dtype bf16 --rows 32768 --hidden 4096`` (V = 151,936): the
   chunked CE and CE+KL at 2 chunk sizes against the naive path (full logits), ``F.linear_cross_entropy``
   and the bare GEMMs: time, peak memory, useful TFLOP/s and their fraction of the GPU's dense bf16 peak
   (``conf/gpu/<gpu>.yaml``). The naive CE+KL may run out of memory at this size: reported, not a failure.
colocated. A co-located training run at real size (``topology=colocated``, ``experiment=qwen3_8b_8gpu``): a
   Qwen3-8B-shaped target (the ``shape:`` of ``conf/target/qwen3_8b.yaml`` as config.json, the tiny
   tokenizer) built with random weights directly on the GPU (``target.random_weights=true``, no
   download), the experiment's drafter (5 layers, block 16, 512 anchors per sample, 8192 per packet)
   and token budget (16,384), chat data cut from CPython's stdlib sources, 30 steps with
   ``train.time_phases=true``: samples/s, tokens/s, the step split, the flex_attention compile time
   (step 1 minus the median step), peak memory, and MFU per role = the planner's FLOP per packet
   (``dflash.plan.packet_costs`` on the measured packet) / measured seconds per packet / bf16 peak.
   Before it, a probe of the target's headless forward alone on one packet: peak memory above the
   weights, the largest tensor it makes and every tensor with a vocabulary-sized last dimension (none:
   the lm_head never runs), against ``model(...)`` on the same packet.
hybrid. The same co-located run for 12 steps with a small Qwen3.6-style hybrid target (8 layers, 6 of
   them Gated DeltaNet linear attention, H 2048, Qwen3.6's vocabulary; random weights): packed rows
   through the linear-attention kernels, the row naming the ones that ran.
split. With 2+ GPUs: the disaggregated 1 target + 1 drafter over NCCL for 20 steps, the same figures; with
   more than 2 GPUs on the pair farthest apart in ``nvidia-smi topo -m`` (its row names it).
tp. With 3+ GPUs: one tensor-parallel target replica on GPUs 0-1 (``topology.target_tp=2``: the random
   target sharded with transformers' TP plan, every rank building only its shard) + 1 drafter on GPU 2
   over NCCL for 20 steps: the same figures, the target's per rank (its share of the FLOPs and the
   planner's memory of one rank). NCCL holds one rank per GPU, so 2 GPUs cannot hold a replica of 2
   and a drafter: skipped there.
allreduce, fsdp. With 3+ GPUs: 1 target + 2 drafters over NCCL for 10 steps, the drafters' gradients
   summed by the bucketed all-reduce (the replicas' weights compared every 2 steps) or the drafter
   sharded with FSDP2 (``drafter.shard=full``): the same figures and the gradient reduction per step
   beside the planner's all-reduce.
two_targets. With 3+ GPUs: 2 targets feeding 1 drafter over NCCL for 10 steps.
sigterm. With 2+ GPUs: 1 target + 1 drafter with checkpoints and W&B offline on, SIGTERM to torchrun's
   process group after step 3 (as a scheduler preempting the job): a checkpoint at the step it stopped
   at and no worker killed by torchrun; then the same command again resumes there and trains the rest
   (every step and packet once in the ledger, one W&B offline run per launch of one run id).

``--dry-run`` runs every part through the same code at tiny sizes on CPU in fp32 (the tiny target's
shape, gloo for the parts of several ranks, CUDA hidden), so the GPU path cannot rot between GPU sessions. Output: a
table, then ONE JSON line ``{"parts": ..., "targets": ..., "device": ..., "dry_run": ..., "passed": ...}``
(also written to ``--out``, after every part). The exit code is 1 when a part failed; a performance
target missed is reported ("targets"), not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from dflash.gpu_check.check import Check
from dflash.gpu_check.probe import probe_target
from dflash.gpu_check.procs import child_env
from dflash.gpu_check.profiles import PARTS


def main() -> None:
    """Parse the command line and run the check (or, with the hidden ``--probe-target <json>``, only
    the target probe, printing its JSON line); exits 1 when a part failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dry-run", action="store_true", help="every part on CPU at tiny sizes (fp32); what CI runs"
    )
    p.add_argument(
        "--gpu", default=None, help="conf/gpu spec (h100, h200, b200, a100 or a YAML path); default: detected"
    )
    p.add_argument("--out", default=None, help="also write the JSON summary here (after every part)")
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma list of parts to run (default {','.join(PARTS)})",
    )
    p.add_argument(
        "--total-budget",
        type=float,
        default=None,
        help="seconds for the whole check (default: the budgets' sum)",
    )
    p.add_argument(
        "--work-dir", default=None, help="where the target, data and runs go (default: a temp dir)"
    )
    p.add_argument("--serial", action="store_true", help="dry run: one part after the other (as on a GPU)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, metrics.jsonl of the runs)")
    p.add_argument("--probe-target", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe_target is not None:
        print(json.dumps(probe_target(json.loads(args.probe_target))), flush=True)
        return
    bad = set(args.parts.split(",")) - set(PARTS)
    if bad:
        raise SystemExit(f"--parts: unknown {sorted(bad)}; use a comma list of {','.join(PARTS)}")
    for k, v in child_env(args.dry_run).items():
        if k.startswith(("HF_", "TRANSFORMERS_", "TOKENIZERS_")):
            os.environ.setdefault(k, v)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process too (the probe runs in it)
    chk = Check(args)
    code = 1
    try:
        code = chk.main()
    finally:
        if code != 0 or args.keep or args.work_dir is not None:
            print(f"gpu_check: logs and runs kept in {chk.work}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(chk.work, ignore_errors=True)
    raise SystemExit(code)
