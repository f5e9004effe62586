"""The check's orchestrator: detects the device, plans the time budgets, runs parts kernels, loss and the
training parts (colocated, hybrid, split, tp, allreduce, fsdp, two_targets, sigterm: one method each, a
crash or hang in one reported while the others still run) and writes the JSON summary."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash.distributed.launch import torchrun_command
from dflash.gpu_check.figures import loss_figures, metrics_rows, pytest_counts, step_figures
from dflash.gpu_check.inputs import Inputs, target_shape, write_chat_data, write_target_dir
from dflash.gpu_check.planner import (
    colocated_anchor_cap,
    find_gpu_spec,
    planner_figures,
    probe_planner_activations,
    training_config,
)
from dflash.gpu_check.probe import probe_target
from dflash.gpu_check.procs import Proc, child_env, run_proc
from dflash.gpu_check.profiles import DRY, EXPERIMENT, GPU, PARTS, REPO, TRAIN_PARTS
from dflash.gpu_check.stop import judge_resume, judge_stop, last_step
from dflash.gpu_check.table import render
from dflash.gpu_check.targets import judged_targets
from dflash.gpu_check.topo import farthest_pair, read_topology


def linear_attention_kernels(cuda: bool) -> str:
    """The kernels a hybrid target's packed rows run here (tests/gpu/test_cuda_linear_attention.py
    runs them): flash-linear-attention's varlen delta rule and causal-conv1d when the GPU extra is
    installed, else the torch fallbacks one document at a time."""
    import importlib.util

    import torch

    from dflash.targets.linear_attention import fast_delta_rule

    fast = cuda and fast_delta_rule(torch.device("cuda"))
    delta = "flash-linear-attention (varlen)" if fast else "torch, per document"
    conv = "causal-conv1d" if cuda and importlib.util.find_spec("causal_conv1d") is not None else "torch"
    return f"delta rule {delta}; convolution {conv} (zero gaps between documents)"


def merged(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` then ``extra``, without the ``base`` overrides of a key that ``extra`` sets."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(extra)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def rank_logs(run_dir: Path) -> dict[str, list[str]]:
    """The last 25 lines of every rank's log (a worker's own traceback: torchrun's output ends with
    its summary)."""
    return {
        p.stem: [ln for ln in _read(p).splitlines() if ln.strip()][-25:]
        for p in sorted(run_dir.glob("rank*.log"))
    }


class Check:
    """One run of the check, from the command line's ``args`` (see ``dflash.gpu_check.cli``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.profile = DRY if self.dry else GPU
        self.env = child_env(self.dry)
        self.parts = [p for p in PARTS if p in args.parts.split(",")]
        self.results: dict[str, dict[str, Any]] = {}
        self.device: dict[str, Any] = {}
        self.gpu: str | None = None
        self.spec: Any = None
        self.inputs: Inputs | None = None
        self.anchor_cap: int | None = None
        """The co-located and split parts' drafter.max_anchors_per_packet (None: the experiment's)."""
        self.setup_info: dict[str, Any] = {}
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="dflash-gpu-check-")).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.started = self.t0 = time.perf_counter()
        self.plan: list[str] = []
        self.total_s = 0.0
        self.lock, self.setup_lock = threading.Lock(), threading.Lock()
        self.concurrent = self.dry and not args.serial
        """A dry run runs the parts side by side, as many as the host has cores (its figures mean
        nothing, its wall time is CI's); on a GPU each part runs alone, so that it measures alone."""

    # ------------------------------------------------------------- budgets
    def plan_budget(self) -> None:
        """The steps that will run (in order) and the total time they get."""
        b = self.profile.budgets
        steps = []
        if "kernels" in self.parts:
            steps.append("kernels")
        if "loss" in self.parts:
            steps.append("loss")
        if set(TRAIN_PARTS) & set(self.parts):
            steps.append("setup")
        if "colocated" in self.parts:
            steps += ["target_probe", "colocated"]
        for part in TRAIN_PARTS:
            if part != "colocated" and part in self.parts and self.gpus_for(part):
                steps.append(part)
        self.plan = steps
        self.total_s = self.args.total_budget or sum(b[s] for s in steps)

    def gpus_for(self, part: str) -> bool:
        """Whether training part ``part`` can run: one GPU per rank, or a dry run (gloo on CPU)."""
        return self.dry or self.device.get("count", 0) >= TRAIN_PARTS[part].nproc

    def timeout(self, step: str) -> float:
        """This step's budget plus what the earlier steps left unused (never the later steps' share);
        side by side (a dry run) its own budget."""
        if self.concurrent:
            return self.profile.budgets[step]
        later = self.plan[self.plan.index(step) + 1 :]
        left = self.total_s - (time.perf_counter() - self.t0)
        return max(0.0, left - sum(self.profile.budgets[s] for s in later))

    def run(self, step: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        """``cmd`` as ``step``'s subprocess, within its budget, logged to ``logs/<step>.{out,err}``."""
        return run_proc(cmd, self.timeout(step), self.logs, step, env or self.env)

    # ------------------------------------------------------------- device
    def detect_device(self) -> None:
        """torch's view of the GPUs, in this process (reading device properties makes no allocation)."""
        import torch

        d: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
        d["count"] = torch.cuda.device_count() if d["cuda"] else 0
        if d["cuda"]:
            p = torch.cuda.get_device_properties(0)
            d.update(
                name=p.name,
                capability=f"{p.major}.{p.minor}",
                memory_gib=round(p.total_memory / 2**30, 1),
                cuda_version=torch.version.cuda,
            )
            try:
                d["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
            except Exception:  # a build without NCCL: part split will say so
                pass
        self.device = d
        if not self.dry and not d["cuda"]:
            raise SystemExit(
                f"gpu_check: no CUDA device visible to torch {d['torch']}; on a CPU machine run: "
                "python scripts/gpu_check.py --dry-run"
            )
        if self.dry:
            d["name"] = "cpu (dry run)"
        self.gpu, self.spec = find_gpu_spec(
            None if self.dry else d.get("name"), self.args.gpu or ("h200" if self.dry else None)
        )

    # ------------------------------------------------------------- part kernels
    def part_kernels(self) -> dict[str, Any]:
        """``pytest -m gpu tests/gpu``: counts and status (every test skipped on CPU is not a failure)."""
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/gpu"]
        proc = self.run("kernels", cmd)
        counts = pytest_counts(proc.stdout)
        res: dict[str, Any] = {
            "counts": counts,
            "seconds": round(proc.seconds, 1),
            "linear_attention": linear_attention_kernels(bool(self.device["cuda"]) and not self.dry),
        }
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        if failed:
            res["failed_tests"] = failed[:10]
        if proc.timed_out:
            return {**res, "status": "timeout", "tail": proc.tail()}
        if counts["failed"] or counts["errors"] or proc.rc not in (0, 5):
            return {**res, "status": "failed", "tail": proc.tail()}
        if self.device["cuda"] and not self.dry:
            if counts["passed"] == 0:
                return {
                    **res,
                    "status": "failed",
                    "note": "no CUDA test ran on a CUDA host",
                    "tail": proc.tail(),
                }
            return {**res, "status": "passed"}
        if counts["skipped"] == 0:
            return {**res, "status": "failed", "note": "no test collected", "tail": proc.tail()}
        return {**res, "status": "skipped", "note": "no CUDA: every test skipped (expected on CPU)"}

    # ------------------------------------------------------------- part loss
    def part_loss(self) -> dict[str, Any]:
        """``scripts/bench_loss.py`` at the profile's sizes: its cases against the GPU's bf16 peak."""
        per_case = max(30.0, self.profile.budgets["loss"] / 2)
        cmd = [sys.executable, "scripts/bench_loss.py", *self.profile.bench, "--timeout", str(per_case)]
        proc = self.run("loss", cmd)
        recs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not recs:  # killed at the budget: the cases finished so far (without the ratios)
            for ln in proc.stderr.splitlines():
                if ln.startswith('{"progress"'):
                    recs.append(json.loads(ln)["progress"])
        res = loss_figures(recs, self.spec.bf16_tflops if self.spec is not None else None)
        res.update(args=" ".join(self.profile.bench), seconds=round(proc.seconds, 1))
        if proc.timed_out:
            return {**res, "status": "timeout", "tail": proc.tail()}
        if proc.rc != 0 and res["status"] == "passed":
            return {**res, "status": "failed", "tail": proc.tail()}
        return res

    # ------------------------------------------------------------- the training parts
    def base_overrides(self, inputs: Inputs) -> list[str]:
        """The training overrides of the training parts before their topology and step count."""
        return [
            f"experiment={EXPERIMENT}",
            f"target.path={inputs.target_dir}",
            "target.tiny=null",
            "target.random_weights=true",
            f"data.path={inputs.data_path}",
            f"data.cache_dir={self.work / 'data_cache'}",
            "train.time_phases=true",
            "train.save_weights=false",
            "logging=disabled",
            "logging.progress_bar=false",
            "eval.every=0",
            *self.profile.overrides,
            *([f"drafter.max_anchors_per_packet={self.anchor_cap}"] if self.anchor_cap is not None else []),
        ]

    def setup(self) -> Inputs:
        """The target directory and the chat data, shared by the training parts (in-process)."""
        t0 = time.perf_counter()
        target_dir, data_path = self.work / "target", self.work / "chat.jsonl"
        shape = target_shape(self.profile.target)
        how = write_target_dir(target_dir, shape, self.profile.max_position_embeddings)
        probe_cfg = training_config(self.base_overrides(Inputs(target_dir, data_path, 0, shape, 0)))
        sample = self.profile.prompt_tokens + self.profile.response_tokens + 12  # + chat template
        per_packet = max(1, probe_cfg.data.token_budget // sample)
        packets = max(n * TRAIN_PARTS[part].drafters for part, n in self.profile.steps.items())
        num_samples = int(packets * per_packet * 1.25) + per_packet
        vocab_used = write_chat_data(
            data_path, target_dir, num_samples, self.profile.prompt_tokens, self.profile.response_tokens
        )
        inputs = Inputs(target_dir, data_path, num_samples, shape, vocab_used)
        shipped = probe_cfg.drafter.max_anchors_per_packet
        if not self.dry and self.spec is not None:
            cap, shipped = colocated_anchor_cap(self.base_overrides(inputs), self.spec)
            self.anchor_cap = cap if cap != shipped else None
        d = training_config(self.base_overrides(inputs)).drafter
        self.setup_info = {
            "seconds": round(time.perf_counter() - t0, 1),
            "target_dir": str(target_dir),
            "target_shape": shape,
            "tokenizer": how,
            "data": f"{num_samples} conversations of ~{sample} tokens ({per_packet} per packet)",
            "experiment": EXPERIMENT,
            "token_budget": probe_cfg.data.token_budget,
            "drafter": {
                "num_layers": d.num_layers,
                "block_size": d.block_size,
                "num_anchors": d.num_anchors,
                "max_anchors_per_packet": d.max_anchors_per_packet,
                "experiment_max_anchors_per_packet": shipped,
            },
            "target_dtype": probe_cfg.target.dtype,
        }
        return inputs

    def part_target_probe(self, inputs: Inputs) -> dict[str, Any]:
        """The target probe on one packet of part colocated's config (in this process in a dry run, else
        ``scripts/gpu_check.py --probe-target``), beside the planner's activations; it fails when the
        headless forward makes a vocabulary-sized tensor or ``model(...)`` makes none."""
        overrides = [*self.base_overrides(inputs), "topology=colocated"]
        cfg = training_config(overrides)
        tokens = cfg.data.token_budget
        docs = self.profile.probe_docs
        spec = {"overrides": overrides, "tokens": tokens, "docs": docs, "vocab_used": inputs.vocab_used}
        t0 = time.perf_counter()
        if self.profile.inline_probe:
            res = json.loads(json.dumps(probe_target(spec)))
        else:
            entry = REPO / "scripts" / "gpu_check.py"
            proc = self.run("target_probe", [sys.executable, str(entry), "--probe-target", json.dumps(spec)])
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.rc != 0 or not lines:
                status = "timeout" if proc.timed_out else "failed"
                return {"status": status, "seconds": round(proc.seconds, 1), "tail": proc.tail()}
            res = json.loads(lines[-1])
        res["planner_activations_gib"] = probe_planner_activations(overrides, tokens, docs, res["num_taps"])
        res["seconds"] = round(time.perf_counter() - t0, 1)
        ok = res["headless"]["vocab_tensors"] == 0 and res["full"]["vocab_tensors"] >= 1
        res["status"] = "passed" if ok else "failed"
        if not ok:
            res["note"] = (
                "the headless forward made a vocabulary-sized tensor"
                if res["headless"]["vocab_tensors"]
                else "model(...) made no vocabulary-sized tensor: the probe sees nothing"
            )
        return res

    def part_overrides(self, part: str, inputs: Inputs, extra: Sequence[str] = ()) -> list[str]:
        """Training part ``part``'s overrides: the base ones, its topology and settings, its step count,
        then ``extra`` (each replacing a base override of the same key)."""
        tp = TRAIN_PARTS[part]
        base = [
            *self.base_overrides(inputs),
            *tp.topology,
            *tp.overrides,
            f"train.max_steps={self.profile.steps[part]}",
        ]
        return merged(base, extra)

    def command_text(self, part: str, overrides: list[str]) -> str:
        """The part's torchrun command as the table shows it (the work dir's paths left out)."""
        return (
            f"torchrun --standalone --nproc_per_node {TRAIN_PARTS[part].nproc} -m dflash.train "
            + " ".join(
                o for o in overrides if not o.startswith(("target.path=", "data.path=", "data.cache_dir="))
            )
        )

    def train_part(
        self, part: str, inputs: Inputs, extra: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """A torchrun training run of training part ``part`` (``TRAIN_PARTS``) with ``extra`` overrides
        and ``env``: its steady-state figures, the planner's figures on it, and on failure the ranks'
        logs."""
        tp = TRAIN_PARTS[part]
        steps = self.profile.steps[part]
        run_dir = self.work / f"run_{part}"
        overrides = self.part_overrides(part, inputs, extra)
        cmd = torchrun_command(tp.nproc, [f"hydra.run.dir={run_dir}", *overrides])
        env = env or self.env
        # Dynamo logs every recompilation (flex_attention and its block mask must compile once).
        proc = self.run(part, cmd, env={**env, "TORCH_LOGS": env.get("TORCH_LOGS", "recompiles")})
        rows = metrics_rows(run_dir)
        res: dict[str, Any] = {
            "mode": tp.mode,
            "backend": "gloo" if self.dry else "nccl",
            "command": self.command_text(part, overrides),
            "wall_s": round(proc.seconds, 1),
            "steps_requested": steps,
            "recompiles": (proc.stdout + proc.stderr).count("Recompiling function"),
            "recompile_limit_hit": "torch._dynamo hit config." in proc.stdout + proc.stderr,
        }
        if self.anchor_cap is not None:
            shipped = self.setup_info["drafter"]["experiment_max_anchors_per_packet"]
            res["anchors"] = (
                f"drafter.max_anchors_per_packet={self.anchor_cap}: the experiment's {shipped} does not fit "
                f"a co-located {self.gpu} with checkpointing (planner)"
            )
        if rows:
            try:
                res.update(step_figures(rows, self.profile.warmup_steps, packets_per_step=tp.drafters))
                res["planner"] = planner_figures(
                    overrides,
                    self.gpu,
                    res["packet"],
                    res["target_s_per_packet"] or 0.0,
                    res["drafter_s_per_packet"] or 0.0,
                )
            except Exception as e:  # the figures must not hide the run's own outcome
                res["figures_error"] = f"{type(e).__name__}: {e}"
            peaks = res.get("peak_mem_gib", {})
            res["peak_mem_gib_by_role"] = (  # a replica's memory: its sender's (rank 0)
                {"colocated": peaks.get("0")}
                if tp.nproc == 1
                else {"target": peaks.get("0"), "drafter": peaks.get(str(tp.nproc - 1))}
            )
        if proc.timed_out or proc.rc != 0 or len(rows) != steps or "figures_error" in res:
            if proc.out_of_memory():
                res["note"] = "out of memory: lower drafter.max_anchors_per_packet or data.token_budget"
            status = "timeout" if proc.timed_out else "failed"
            return {
                **res,
                "status": status,
                "rc": proc.rc,
                "rank_logs": rank_logs(run_dir),
                "tail": proc.tail(20),
            }
        return {**res, "status": "passed"}

    def part_colocated(self) -> dict[str, Any]:
        """The target probe, then the co-located training run; the probe's failure fails the part."""
        inputs = self.ensure_inputs()
        probe = self.part_target_probe(inputs)
        res = self.train_part("colocated", inputs)
        res["target_probe"] = probe
        if "headless" in probe:  # the target role alone: its weights and one headless forward
            role = res.setdefault("peak_mem_gib_by_role", {})
            role["target_alone"] = round(probe["weights_gib"] + probe["headless"]["extra_gib"], 3)
        if probe["status"] != "passed" and res["status"] == "passed":
            res["status"] = probe["status"]
        return res

    def part_hybrid(self) -> dict[str, Any]:
        """A co-located training run with a hybrid target (the profile's Qwen3.5/3.6-style shape,
        random weights): packed rows through its Gated DeltaNet layers, and the kernels the
        target's loader says they ran (flash-linear-attention's varlen delta rule on CUDA with the
        GPU extra, else the torch fallback one document at a time)."""
        inputs = self.ensure_inputs()
        target_dir = self.ensure_hybrid_target()
        taps = ",".join(str(i) for i in self.profile.hybrid_layer_ids)
        res = self.train_part("hybrid", inputs, [f"target.path={target_dir}", f"target.layer_ids=[{taps}]"])
        shape = self.profile.hybrid_shape
        res["target"] = (
            f"{shape['model_type']}: {shape['num_layers']} layers ({shape['num_linear_layers']} linear attention), "
            f"H {shape['hidden_size']}, V {shape['vocab_size']}"
        )
        log = _read(self.work / "run_hybrid" / "rank0.log")
        kernels = re.findall(r"linear-attention layers on packed rows: (.+)", log)
        loaded = re.findall(r"loaded target \S+ \((\w+), (\w+) attention\)", log)
        res["linear_attention"] = kernels[-1].strip() if kernels else None
        if loaded:
            res["target_model"] = f"{loaded[-1][0]}, {loaded[-1][1]} attention in the full-attention layers"
        if res["status"] == "passed" and not kernels:
            return {
                **res,
                "status": "failed",
                "note": "the target's loader installed no linear-attention kernels",
            }
        return res

    def skipped(self, part: str) -> dict[str, Any]:
        """The row of a training part this host has too few GPUs for (NCCL holds one rank per GPU)."""
        need = TRAIN_PARTS[part].nproc
        return {
            "status": "skipped",
            "note": f"{self.device.get('count', 0)} GPU: needs {need}+",
            "ran": False,
        }

    def part_split(self) -> dict[str, Any]:
        """The 1 target + 1 drafter training run; with more than 2 GPUs on the pair farthest apart
        (``nvidia-smi topo -m``); skipped with fewer than 2 GPUs."""
        if not self.gpus_for("split"):
            return self.skipped("split")
        env, where = self.env, "CPU (gloo)" if self.dry else "GPUs 0,1"
        if not self.dry and self.device.get("count", 0) > 2:
            (a, b), why = farthest_pair(
                self.device["count"], os.environ.get("CUDA_VISIBLE_DEVICES"), read_topology()
            )
            env = {**self.env, "CUDA_VISIBLE_DEVICES": f"{a},{b}"}
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # nvidia-smi's numbering
            where = f"GPUs {a},{b} ({why})"
        return {**self.train_part("split", self.ensure_inputs(), env=env), "gpus": where}

    def part_tp(self) -> dict[str, Any]:
        """The training run with a tensor-parallel target replica (the random target sharded over 2
        GPUs with transformers' TP plan, NCCL) + 1 drafter; skipped with fewer than 3 GPUs (NCCL
        holds one rank per GPU: the replica's 2 and the drafter's)."""
        if not self.gpus_for("tp"):
            return {
                **self.skipped("tp"),
                "note": f"{self.device.get('count', 0)} GPU: needs 3+ (a 2-GPU replica + a drafter)",
            }
        return self.train_part("tp", self.ensure_inputs())

    def part_allreduce(self) -> dict[str, Any]:
        """1 target + 2 unsharded drafters: their gradients summed by the bucketed all-reduce over the
        drafter group, the replicas' weights compared every 2 steps (a difference stops the run)."""
        if not self.gpus_for("allreduce"):
            return self.skipped("allreduce")
        res = self.train_part("allreduce", self.ensure_inputs())
        if res["status"] == "passed":
            res["replicas"] = "equal at every check (train.check_replicas_every=2)"
        return res

    def part_fsdp(self) -> dict[str, Any]:
        """1 target + 2 drafters sharding the drafter with FSDP2 (``drafter.shard=full``: weights,
        gradients and AdamW state split over the drafters, weights gathered one layer at a time)."""
        if not self.gpus_for("fsdp"):
            return self.skipped("fsdp")
        return self.train_part("fsdp", self.ensure_inputs())

    def part_two_targets(self) -> dict[str, Any]:
        """2 targets feeding one drafter (packet g from target g mod 2): the drafter receives from
        both links in turn."""
        if not self.gpus_for("two_targets"):
            return self.skipped("two_targets")
        return self.train_part("two_targets", self.ensure_inputs())

    def part_sigterm(self) -> dict[str, Any]:
        """1 target + 1 drafter with checkpoints and W&B offline on, sent SIGTERM (to torchrun's
        process group, as a scheduler preempting the job does) once its ledger holds step
        ``sigterm_at_step``; then the same command again, which must resume from the stop's checkpoint
        and train the rest (``dflash.gpu_check.stop`` judges both)."""
        if not self.gpus_for("sigterm"):
            return self.skipped("sigterm")
        inputs = self.ensure_inputs()
        tp, steps, at = TRAIN_PARTS["sigterm"], self.profile.steps["sigterm"], self.profile.sigterm_at_step
        run_dir = self.work / "run_sigterm"
        drafter = tp.nproc - 1
        overrides = self.part_overrides(
            "sigterm",
            inputs,
            [
                "train.save_weights=true",
                f"train.save_every={steps}",
                "logging=offline",
                "logging.progress_bar=false",
            ],
        )
        cmd = torchrun_command(tp.nproc, [f"hydra.run.dir={run_dir}", *overrides])
        env = {**self.env, "WANDB_MODE": "offline"}
        deadline = time.perf_counter() + self.timeout("sigterm")
        res: dict[str, Any] = {
            "mode": tp.mode,
            "backend": "gloo" if self.dry else "nccl",
            "command": self.command_text("sigterm", overrides),
        }
        first = run_proc(
            cmd, deadline - time.perf_counter(), self.logs, "sigterm", env, lambda: last_step(run_dir) >= at
        )
        res.update(judge_stop(run_dir, first, steps, at, drafter))
        problems = res.pop("problems")
        if not problems:
            log_from = len(_read(run_dir / f"rank{drafter}.log"))
            second = run_proc(cmd, deadline - time.perf_counter(), self.logs, "sigterm_resume", env)
            resumed = judge_resume(
                run_dir, second, res["stopped_at_step"], steps, tp.drafters, drafter, log_from
            )
            problems = resumed.pop("problems")
            res.update(resumed)
            if problems:
                res["tail"] = second.tail(20)
        else:
            res["tail"] = first.tail(20)
        res["wall_s"] = round(first.seconds + res.get("resume_wall_s", 0.0), 1)
        rows = metrics_rows(run_dir)
        res["steps"] = len(rows)
        if rows:
            res["final_loss"] = round(float(rows[-1]["train/loss"]), 4)
        if problems:
            return {**res, "status": "failed", "errors": problems, "rank_logs": rank_logs(run_dir)}
        return {**res, "status": "passed"}

    # ------------------------------------------------------------- output
    def summary(self, done: bool) -> dict[str, Any]:
        """The JSON summary; ``passed`` is null until ``done``."""
        ok = {p: r.get("status") in ("passed", "skipped") for p, r in self.results.items()}
        return {
            "parts": self.results,
            "targets": judged_targets(self.results, judged=not self.dry),
            "device": {
                **self.device,
                "gpu_spec": self.gpu,
                "bf16_peak_tflops": getattr(self.spec, "bf16_tflops", None),
            },
            "dry_run": self.dry,
            "setup": self.setup_info,
            "budget_s": {s: self.profile.budgets[s] for s in self.plan},
            "total_budget_s": self.total_s,
            "wall_s": round(time.perf_counter() - self.started, 1),
            "work_dir": str(self.work),
            "passed": (all(ok.values()) and len(ok) == len(self.parts)) if done else None,
        }

    def write(self, done: bool) -> dict[str, Any]:
        """The summary, also written (atomically) to ``--out`` when given."""
        out = self.summary(done)
        if self.args.out:
            path = Path(self.args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            tmp.replace(path)
        return out

    def ensure_inputs(self) -> Inputs:
        """The inputs of the training parts, set up by the first part that asks."""
        with self.setup_lock:  # the training parts share one target directory and data file
            if self.inputs is None:
                self.inputs = self.setup()
            return self.inputs

    def ensure_hybrid_target(self) -> Path:
        """Part hybrid's target directory: config.json of the profile's hybrid shape + the tokenizer
        (the main target's, so the chat data serves both)."""
        out = self.work / "target_hybrid"
        with self.setup_lock:
            if not (out / "config.json").is_file():
                write_target_dir(out, self.profile.hybrid_shape, self.profile.max_position_embeddings)
        return out

    def run_part(self, part: str) -> None:
        """Run one part and record its result (a crash becomes status ``error``)."""
        t0 = time.perf_counter()
        try:
            res = getattr(self, f"part_{part}")()
        except Exception as e:  # one part's crash is reported; the others still run
            res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        res.setdefault("ran", True)
        res["part_s"] = round(time.perf_counter() - t0, 1)
        with self.lock:
            self.results[part] = res
            print(f"  part {part}: {res['status']} ({res['part_s']} s)", file=sys.stderr, flush=True)
            self.write(done=False)

    def header(self) -> str:
        """Where the check runs, the budgets of its steps and the work dir."""
        d = self.device
        if self.dry:
            where = f"CPU dry run (tiny sizes, fp32; fractions of the {self.gpu} peak are meaningless here)"
        else:
            spec = (
                f"{self.gpu}: {self.spec.bf16_tflops:g} dense bf16 TFLOP/s"
                if self.spec
                else "no conf/gpu spec (--gpu)"
            )
            where = f"{d.get('name')} x{d.get('count')} ({spec}), torch {d.get('torch')}, CUDA {d.get('cuda_version')}"
        budgets = ", ".join(f"{s} {self.profile.budgets[s]:g}" for s in self.plan)
        skipped = [p for p in self.parts if p in TRAIN_PARTS and not self.gpus_for(p)]
        return (
            f"dflash GPU check: {where}\n"
            f"budgets (s): {budgets}; total {self.total_s:g} "
            + ("(parts side by side)" if self.concurrent else "(unused time passes to the next part)")
            + (
                f"; skipped ({self.device.get('count', 0)} GPU, NCCL needs one per rank): "
                + ", ".join(f"{p} ({TRAIN_PARTS[p].nproc})" for p in skipped)
                if skipped
                else ""
            )
            + f"\nwork dir: {self.work}"
        )

    def main(self) -> int:
        """Every part (side by side in a dry run), then the table and the JSON line; the exit code:
        0 when every part passed or was skipped, else 1."""
        self.detect_device()
        self.plan_budget()
        print(self.header(), flush=True)
        self.t0 = time.perf_counter()  # the budgets start with the first part
        if self.concurrent:  # the longest first, at most one part per core (4 at least)
            workers = min(len(self.parts), max(4, os.cpu_count() or 1))
            longest = sorted(self.parts, key=lambda p: -self.profile.budgets.get(p, 0))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(self.run_part, longest))
        else:
            for part in self.parts:
                self.run_part(part)
        self.results = {p: self.results[p] for p in self.parts}
        out = self.write(done=True)
        print(render(out), flush=True)
        print(json.dumps(out), flush=True)
        return 0 if out["passed"] else 1
