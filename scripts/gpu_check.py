#!/usr/bin/env python
"""GPU readiness check: one command that proves the product on a GPU host and says how fast it is.

    make gpu-check                                        # = python scripts/gpu_check.py --out gpu_check.json
    python scripts/gpu_check.py --out /tmp/gpu_check.json # the GPU is detected (--gpu h200 overrides)
    python scripts/gpu_check.py --dry-run                 # every part on CPU at tiny sizes, fp32 (CI runs it)
    python scripts/gpu_check.py --parts b,c               # a subset (e.g. to rerun what failed)

Parts, each run as a subprocess with its own time budget (printed up front and enforced: a hang or a
crash in one part is reported and the other parts still run; time a part leaves unused goes to the
next ones; on one H200 the budgets add up to 8 minutes):

a. ``pytest -m gpu tests/gpu``: the CUDA tests (chunked loss fp32/bf16/compiled, compiled flex_attention
   against dense SDPA) and their pass/fail/skip counts. On CPU all of them skip: reported, not a failure.
b. ``scripts/bench_loss.py --device cuda --dtype bf16 --rows 32768 --hidden 4096`` (V = 151,936): the
   chunked CE and CE+KL at 2 chunk sizes against the naive path (full logits), ``F.linear_cross_entropy``
   and the bare GEMMs: time, peak memory, useful TFLOP/s and their fraction of the GPU's dense bf16 peak
   (``conf/gpu/<gpu>.yaml``). The naive CE+KL may run out of memory at this size: reported, not a failure.
c. A co-located training run at real size (``topology=colocated``, ``experiment=qwen3_8b_8gpu``): a
   Qwen3-8B-shaped target (the ``shape:`` of ``conf/target/qwen3_8b.yaml`` as config.json, the tiny
   tokenizer) built with random weights directly on the GPU (``target.random_weights=true``, no
   download), the experiment's drafter (5 layers, block 16, 512 anchors per sample, 2048 per packet)
   and token budget (16,384), chat data cut from CPython's stdlib sources, 30 steps with
   ``train.time_phases=true``: samples/s, tokens/s, the step split, the flex_attention compile time
   (step 1 minus the median step), peak memory, and MFU per role = the planner's FLOP per packet
   (``dflash.plan.packet_costs`` on the measured packet) / measured seconds per packet / bf16 peak.
   Before it, a probe of the target's headless forward alone on one packet: peak memory above the
   weights, the largest tensor it makes and every tensor with a vocabulary-sized last dimension (none:
   the lm_head never runs), against ``model(...)`` on the same packet.
d. With 2+ GPUs: the disaggregated 1 target + 1 drafter over NCCL for 20 steps, the same figures.

``--dry-run`` runs every part through the same code at tiny sizes on CPU in fp32 (the tiny target's
shape, gloo for part d, CUDA hidden), so the GPU path cannot rot between GPU sessions. Output: a
table, then ONE JSON line ``{"parts": ..., "targets": ..., "device": ..., "dry_run": ..., "passed": ...}``
(also written to ``--out``, after every part). The exit code is 1 when a part failed; a performance
target missed is reported ("targets"), not a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXPERIMENT = "qwen3_8b_8gpu"
PARTS = ("a", "b", "c", "d")
PHASES = ("target_forward", "recv_wait", "drafter_forward", "loss", "backward", "reduce", "optimizer")
LOSS_GOAL, DRAFTER_MFU_GOAL = 0.60, 0.40
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
    """Seconds per step of the check: a, b, setup (in-process), c_probe, c, d."""
    inline_probe: bool
    """Run the target probe in this process (the dry run: one interpreter start less)."""


GPU = Profile(
    name="gpu",
    target="qwen3_8b",
    max_position_embeddings=40960,
    overrides=(),
    prompt_tokens=290,  # + 700 + the chat template: 16 samples of ~1000 tokens fill a 16,384 budget
    response_tokens=700,
    steps={"c": 30, "d": 20},
    warmup_steps=5,
    probe_docs=16,
    bench=(
        *("--device", "cuda", "--dtype", "bf16"),
        *("--rows", "32768", "--hidden", "4096", "--vocab", "151936"),
        *("--chunks", "2048,8192", "--repeats", "3", "--warmup", "1"),
    ),
    # One H200: 90 + 110 + 30 + 45 + 200 = 475 s, + ~5 s of this script's own start and end: 8 minutes.
    # d (2+ GPUs only) adds its own 200 s.
    budgets={"a": 90, "b": 110, "setup": 30, "c_probe": 45, "c": 200, "d": 200},
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
    steps={"c": 4, "d": 4},
    warmup_steps=1,
    probe_docs=4,
    bench=(
        *("--device", "cpu", "--dtype", "fp32", "--threads", "1", "--inline"),
        *("--rows", "256", "--hidden", "32", "--vocab", "2048"),
        *("--chunks", "64,256", "--repeats", "1", "--warmup", "0"),
    ),
    budgets={"a": 120, "b": 120, "setup": 120, "c_probe": 120, "c": 240, "d": 240},
    inline_probe=True,
)


# ---------------------------------------------------------------------------------------------
# subprocesses


@dataclass
class Proc:
    rc: int | None
    """Exit code; None when the budget ran out and the process tree was killed."""
    seconds: float
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def tail(self, n: int = 12) -> list[str]:
        lines = [ln for ln in (self.stderr + "\n" + self.stdout).splitlines() if ln.strip()]
        return lines[-n:]

    def out_of_memory(self) -> bool:
        text = self.stdout + self.stderr
        return any(m in text for m in OOM_MARKERS)


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process (Linux /proc)."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (torchrun starts each worker in a session of its
    own, so killing the process group is not enough)."""
    children = _children()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_proc(cmd: list[str], timeout: float, log_dir: Path, name: str, env: dict[str, str]) -> Proc:
    """Run ``cmd`` in the repository with output to files (``log_dir/name.{out,err}``); on timeout
    (or Ctrl-C) the whole process tree is killed."""
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    t0 = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        rc: int | None
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            rc = None
        except BaseException:
            kill_tree(proc.pid)
            proc.wait()
            raise
    return Proc(
        rc,
        time.perf_counter() - t0,
        out_path.read_text(errors="replace"),
        err_path.read_text(errors="replace"),
    )


def child_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        HYDRA_FULL_ERROR="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("WANDB_API_KEY", None)
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU host
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny sizes: threads only spin against each other
    return env


# ---------------------------------------------------------------------------------------------
# config and planner (in-process: pure Python, no CUDA)


_COMPOSE_LOCK = threading.Lock()


def compose_config(overrides: list[str]):
    """The training config of ``overrides`` (``hydra.*`` ones dropped), typed."""
    from hydra import compose, initialize_config_dir

    from dflash.config import register_configs, to_config

    register_configs()
    with _COMPOSE_LOCK, initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])
    return to_config(dcfg)


def find_gpu_spec(device_name: str | None, override: str | None):
    """``(name, GpuSpec)`` of ``--gpu`` or of the conf/gpu file whose stem is in the device name."""
    from dflash.plan.inputs import GPU_DIR, load_gpu

    if override:
        return Path(override).stem, load_gpu(override)
    low = (device_name or "").lower()
    for path in sorted(GPU_DIR.glob("*.yaml")):
        if path.stem.lower() in low:
            return path.stem, load_gpu(path.stem)
    return None, None


def planner_figures(
    overrides: list[str], gpu: str | None, packet: dict[str, float], t_s: float, d_s: float
) -> dict[str, Any]:
    """The planner on the run's config: FLOP per role for the measured packet, TFLOP/s and MFU from
    the measured seconds per packet, and the memory per role it predicts."""
    from dflash.plan.costs import packet_costs
    from dflash.plan.inputs import VERIFIER_METRICS, attention_kinds, resolve_inputs
    from dflash.plan.planner import make_plan

    cfg = compose_config([*overrides, *([f"plan.gpu={gpu}"] if gpu else [])])
    inputs = resolve_inputs(cfg)
    plan = make_plan(cfg, inputs)
    tokens = max(1, round(packet["tokens"]))
    shape = dataclasses.replace(
        inputs.packet,
        tokens=tokens,
        num_seqs=max(1, round(packet["seqs"])),
        num_anchors=round(packet["blocks"]),
        loss_rows=round(packet["supervised_slots"]),
        target_tokens=tokens,
        target_row_tokens=tokens if cfg.target.pack else inputs.packet.target_row_tokens,
    )
    t_kind, d_kind = attention_kinds(cfg, shape.num_seqs)
    costs = packet_costs(
        inputs.target.shape,
        inputs.arch,
        shape,
        cfg.loss,
        target_attention=t_kind,
        drafter_attention=d_kind,
        verifier_metrics=VERIFIER_METRICS,
        hidden_dtype_bytes=inputs.dtypes.target_bytes,
    )
    peak = inputs.gpu.bf16_tflops
    out: dict[str, Any] = {
        "gpu_spec": cfg.plan.gpu,
        "bf16_peak_tflops": peak,
        "target_tflop_per_packet": round(costs.target_flop / 1e12, 4),
        "drafter_tflop_per_packet": round(costs.drafter_flop / 1e12, 4),
        "attention": {"target": t_kind, "drafter": d_kind},
        "memory_gib": {role: round(sum(items.values()), 2) for role, items in plan.memory.items()},
        "capacity_gib": round(plan.capacity_gib, 1),
    }
    for role, flop, sec in (("target", costs.target_flop, t_s), ("drafter", costs.drafter_flop, d_s)):
        tflops = flop / sec / 1e12 if sec > 0 else 0.0
        out[f"{role}_tflops"] = _sig(tflops)
        out[f"{role}_mfu"] = _sig(tflops / peak)
    # What the planner expects of this packet at plan.mfu_* (0.4): co-located one GPU does both
    # roles in turn; 1 target + 1 drafter is bound by the slower role.
    t_plan = costs.target_flop / (cfg.plan.mfu_target * peak * 1e12)
    d_plan = costs.drafter_flop / (cfg.plan.mfu_drafter * peak * 1e12)
    per_packet = t_plan + d_plan if cfg.topology.colocated else max(t_plan, d_plan)
    out["planner_s_per_packet"] = {
        "target": _sig(t_plan),
        "drafter": _sig(d_plan),
        "mfu": cfg.plan.mfu_drafter,
    }
    out["planner_samples_per_s"] = _sig(packet["seqs"] / per_packet)
    return out


def probe_planner_activations(overrides: list[str], tokens: int, docs: int, num_taps: int) -> float:
    """The memory model's activations of the target's headless forward on the probe's packet (GiB)."""
    from dflash.plan.costs import PacketShape
    from dflash.plan.inputs import attention_kinds, resolve_target, run_dtypes
    from dflash.plan.memory import target_memory

    cfg = compose_config(overrides)
    packet = PacketShape(tokens=tokens, num_seqs=docs, num_anchors=0)
    kind = attention_kinds(cfg, docs)[0]
    mem = target_memory(
        resolve_target(cfg).shape, packet, num_taps, attention=kind, max_in_flight=0, dtypes=run_dtypes(cfg)
    )
    return round(mem["activations"], 3)


# ---------------------------------------------------------------------------------------------
# the target directory and the chat data (setup of parts c and d)


@dataclass
class Inputs:
    target_dir: Path
    data_path: Path
    num_samples: int
    shape: dict[str, Any]
    vocab_used: int
    """Token ids the tokenizer produces (the probe draws below it)."""


def _tokenizer_into(out: Path) -> str:
    """The tiny byte-level BPE into ``out``: copied from the cached tiny target when it is built
    (``$DFLASH_CACHE_DIR/tiny_target_v1``), else trained on the stdlib sources (seconds)."""
    from transformers import AutoTokenizer

    from dflash.targets.tiny import build_tokenizer

    cache = Path(os.environ.get("DFLASH_CACHE_DIR", ".cache/dflash"))
    src = (cache if cache.is_absolute() else REPO / cache) / "tiny_target_v1"
    if (src / "tokenizer.json").is_file():
        for f in src.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja"):
                shutil.copy2(f, out / f.name)
        try:
            AutoTokenizer.from_pretrained(out)
            return f"copied from {src}"
        except (OSError, ValueError):
            pass
    build_tokenizer(out)
    return "built (stdlib BPE)"


def write_target_dir(out: Path, profile: Profile) -> tuple[dict[str, Any], str]:
    """config.json of the profile's target shape (model_type qwen3) + the tiny tokenizer: with
    ``target.random_weights=true`` a usable target without any weights file."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    how = _tokenizer_into(out)
    tok = AutoTokenizer.from_pretrained(out)
    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "target" / f"{profile.target}.yaml").shape)
    assert isinstance(shape, dict)
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        tie_word_embeddings=shape.get("tie_word_embeddings", False),
        max_position_embeddings=profile.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3-8B's
        rms_norm_eps=1e-6,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    config.save_pretrained(out)
    return {k: v for k, v in shape.items()}, how


def write_chat_data(path: Path, target_dir: Path, num_samples: int, prompt: int, response: int) -> int:
    """``num_samples`` conversations of ``prompt`` user + ``response`` assistant tokens of stdlib source
    text (cut in tokens, so every sample has about the same length); returns the ids in use."""
    from transformers import AutoTokenizer

    from dflash.data.stdlib import stdlib_text_files

    tok = AutoTokenizer.from_pretrained(target_dir)
    per = prompt + response
    need = num_samples * per
    ids: list[int] = []
    for f in stdlib_text_files():
        ids += tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    with open(path, "w") as fh:
        for i in range(num_samples):
            start = (i * per) % max(1, len(ids) - per)
            user = tok.decode(ids[start : start + prompt])
            assistant = tok.decode(ids[start + prompt : start + per])
            msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return len(tok)


# ---------------------------------------------------------------------------------------------
# the target probe (a subprocess: ``--probe-target <json>``)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def probe_target(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the random target as the trainer does, forward one packet headless (as the target ranks
    do) and through ``model(...)``: peak memory above the weights, largest tensor made, and every
    tensor whose last dimension is the vocabulary (the logits)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from dflash.metrics import reset_peak_memory
    from dflash.setup import torch_dtype
    from dflash.targets.forward import build_batch, target_forward
    from dflash.targets.loader import load_target, read_target_meta, resolve_layer_ids

    cfg = compose_config(spec["overrides"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch_dtype(cfg.target.dtype, device)
    meta = read_target_meta(cfg.target.path)
    layer_ids = resolve_layer_ids(cfg.target, meta)
    t0 = time.perf_counter()
    model = load_target(cfg.target, device, dtype)
    build_s = time.perf_counter() - t0
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    tokens, docs = spec["tokens"], spec["docs"]
    g = torch.Generator().manual_seed(0)
    lens = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    seqs = [torch.randint(0, spec["vocab_used"], (n,), generator=g) for n in lens]
    ids, attn, pos, _ = build_batch(seqs, pack=cfg.target.pack, pad_id=0)
    ids, pos = ids.to(device), pos.to(device)
    attn = attn.to(device) if attn is not None else None

    class Watch(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest: tuple[int, list[int], str] = (0, [], "")
            self.vocab: list[list[int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    size = t.numel() * t.element_size()
                    if size > self.largest[0]:
                        self.largest = (size, list(t.shape), str(t.dtype).removeprefix("torch."))
                    if t.dim() >= 2 and t.shape[-1] == meta.vocab_size:
                        self.vocab.append(list(t.shape))
            return out

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def measured(fn) -> dict[str, Any]:
        sync()
        reset_peak_memory(device)
        before = torch.cuda.memory_allocated(device) if cuda else _rss("VmRSS")
        watch = Watch()
        t = time.perf_counter()
        with watch, torch.inference_mode():
            result = fn()
        sync()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated(device) if cuda else _rss("VmHWM")
        del result
        return {
            "seconds": round(seconds, 4),
            "extra_gib": round(max(0, peak - before) / 2**30, 3),
            "largest_tensor": {
                "shape": watch.largest[1],
                "dtype": watch.largest[2],
                "gib": round(watch.largest[0] / 2**30, 4),
            },
            "vocab_tensors": len(watch.vocab),
            "vocab_tensor_shapes": watch.vocab[:3],
        }

    def headless():
        return target_forward(model, ids, attn, layer_ids, position_ids=pos)

    def full():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits

    with torch.inference_mode():
        headless()  # warm-up: kernels, allocator, workspaces
    sync()
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "docs": docs,
        "build_s": round(build_s, 2),
        "weights_gib": round(weights / 2**30, 3),
        "num_taps": len(layer_ids),
        "logits_gib": round(tokens * meta.vocab_size * torch.finfo(dtype).bits / 8 / 2**30, 3),
        "headless": measured(headless),
        "full": measured(full),
    }


# ---------------------------------------------------------------------------------------------
# reading a training run


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if "train/loss" in row:
            rows.append(row)
    return rows


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (tiny dry-run figures stay visible)."""
    return float(f"{x:.{digits}g}")


def step_figures(rows: list[dict[str, Any]], warmup: int, packets_per_step: int) -> dict[str, Any]:
    """Steady-state medians over the steps after ``warmup``, the compile time (step 1 minus the
    median step), the phase split, the measured packet and the peak memory of every rank."""
    steady = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = {k: _median(steady, k) for k in ("perf/samples_per_s", "perf/tokens_per_s", "perf/step_s")}
    step_s = med["perf/step_s"] or 0.0
    first = float(rows[0]["perf/step_s"])
    phases = {p: _r(_median(steady, f"perf/phase/{p}_s")) for p in PHASES}
    phases = {p: s for p, s in phases.items() if s is not None}

    def per_packet(fn) -> float:
        return statistics.mean(fn(r) for r in steady) / packets_per_step

    packet = {
        "tokens": per_packet(lambda r: r["perf/tokens_per_s"] * r["perf/step_s"]),
        "seqs": per_packet(lambda r: r["perf/samples_per_s"] * r["perf/step_s"]),
        "blocks": per_packet(lambda r: r.get("train/num_blocks", 0.0)),
        "supervised_slots": per_packet(lambda r: r.get("train/supervised_slots", 0.0)),
    }
    fwd_bwd = [phases.get("drafter_forward"), phases.get("backward")]
    split = {
        "target_forward_s": phases.get("target_forward"),
        "recv_wait_s": phases.get("recv_wait"),
        "drafter_forward_backward_s": _r(sum(x for x in fwd_bwd if x is not None)) if any(fwd_bwd) else None,
        "loss_s": phases.get("loss"),
        "optimizer_s": _r((phases.get("optimizer") or 0.0) + (phases.get("reduce") or 0.0)),
    }
    mem_keys = sorted({k for r in rows for k in r if k.startswith("mem/peak_gib/rank_")})
    return {
        "steps": len(rows),
        "steady_steps": f"{rows.index(steady[0]) + 1}-{len(rows)}",
        "samples_per_s": _r(med["perf/samples_per_s"], 3),
        "tokens_per_s": _r(med["perf/tokens_per_s"], 1),
        "step_s": _r(step_s),
        "first_step_s": _r(first),
        "compile_s": _r(max(0.0, first - step_s), 2),
        "phases_s": phases,
        "split_s": {k: v for k, v in split.items() if v is not None},
        "target_s_per_packet": _r(_median(steady, "perf/target_s_per_packet")),
        "drafter_s_per_packet": _r(_median(steady, "perf/drafter_s_per_packet")),
        "busy": {
            k.split("/", 1)[1]: _r(_median(steady, k), 3)
            for k in (
                "perf/target_frac",
                "perf/target_busy_frac",
                "perf/drafter_busy_frac",
                "comm/recv_wait_frac",
            )
            if _median(steady, k) is not None
        },
        "packet": {k: round(v, 1) for k, v in packet.items()},
        "peak_mem_gib": {k.rsplit("_", 1)[1]: round(max(r.get(k, 0.0) for r in rows), 3) for k in mem_keys},
        "final_loss": _r(float(rows[-1]["train/loss"])),
    }


# ---------------------------------------------------------------------------------------------
# the check


def pytest_counts(text: str) -> dict[str, int]:
    """Counts of pytest's final summary line (``3 passed, 2 skipped in 1.2s``)."""
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    lines = [
        ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)
    ]
    for n, what in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1] if lines else ""
    ):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def loss_figures(recs: list[dict[str, Any]], peak: float | None) -> dict[str, Any]:
    """Part b from bench_loss.py's JSON lines: every case with its fraction of the bf16 peak, the
    best chunk of the chunked CE+KL and CE, and the status. Only the product's own cases (chunked,
    chunked_ce) fail the part; a baseline that cannot run (the naive path out of memory, an
    ``F.linear_cross_entropy`` this torch lacks) is reported beside the figures."""
    cases = []
    for r in recs:
        c = {k: r.get(k) for k in ("case", "terms", "chunk", "time_s", "peak_extra_gb")}
        if "error" in r:
            err = str(r["error"])  # "rc=1: <the last 3 lines of stderr, ' | '-joined>"
            c["oom"] = any(m in err for m in OOM_MARKERS)
            c["error"] = err.rsplit(" | ", 1)[-1][:300]  # the exception line (CUDA's OOM one is long)
        else:
            c["tflops"] = r.get("gemm_tflops")
            c["peak_frac"] = _sig(r["gemm_tflops"] / peak) if peak else None
            for k in (
                "time_vs_naive",
                "mem_vs_naive",
                "time_vs_limit",
                "time_vs_torch_lce",
                "mem_vs_torch_lce",
            ):
                if k in r:
                    c[k] = r[k]
        cases.append(c)
    res: dict[str, Any] = {"peak_tflops": peak, "cases": cases}
    for case in ("chunked", "chunked_ce"):
        runs = [c for c in cases if c["case"] == case and "error" not in c]
        if runs:
            res[f"best_{case}"] = min(runs, key=lambda c: c["time_s"])
    res["naive_oom"] = [c["case"] for c in cases if c["case"].startswith("naive") and c.get("oom")]
    failed = [c for c in cases if "error" in c]
    baseline = [
        c for c in failed if c["case"] not in ("chunked", "chunked_ce") and c["case"] not in res["naive_oom"]
    ]
    if baseline:
        res["baseline_errors"] = [f"{c['case']}@{c['chunk']}: {c['error']}" for c in baseline]
    own = [c for c in failed if c["case"] in ("chunked", "chunked_ce")]
    if own or "best_chunked" not in res or "best_chunked_ce" not in res:
        res["errors"] = [f"{c['case']}@{c['chunk']}: {c['error']}" for c in own]
        res["status"] = "failed"
    else:
        res["status"] = "passed"
    return res


class Check:
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
        """A dry run runs the parts side by side (its figures mean nothing, its wall time is CI's);
        on a GPU each part runs alone, so that it measures alone."""

    # ------------------------------------------------------------- budgets
    def plan_budget(self) -> None:
        """The steps that will run (in order) and the total time they get."""
        b = self.profile.budgets
        steps = []
        if "a" in self.parts:
            steps.append("a")
        if "b" in self.parts:
            steps.append("b")
        if {"c", "d"} & set(self.parts):
            steps.append("setup")
        if "c" in self.parts:
            steps += ["c_probe", "c"]
        if "d" in self.parts and self.multi_gpu:
            steps.append("d")
        self.plan = steps
        self.total_s = self.args.total_budget or sum(b[s] for s in steps)

    @property
    def multi_gpu(self) -> bool:
        return self.dry or self.device.get("count", 0) >= 2

    def timeout(self, step: str) -> float:
        """This step's budget plus what the earlier steps left unused (never the later steps' share);
        side by side (a dry run) its own budget."""
        if self.concurrent:
            return self.profile.budgets[step]
        later = self.plan[self.plan.index(step) + 1 :]
        left = self.total_s - (time.perf_counter() - self.t0)
        return max(0.0, left - sum(self.profile.budgets[s] for s in later))

    def run(self, step: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
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
            except Exception:  # a build without NCCL: part d will say so
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

    # ------------------------------------------------------------- part a
    def part_a(self) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/gpu"]
        proc = self.run("a", cmd)
        counts = pytest_counts(proc.stdout)
        res: dict[str, Any] = {"counts": counts, "seconds": round(proc.seconds, 1)}
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

    # ------------------------------------------------------------- part b
    def part_b(self) -> dict[str, Any]:
        per_case = max(30.0, self.profile.budgets["b"] / 2)
        cmd = [sys.executable, "scripts/bench_loss.py", *self.profile.bench, "--timeout", str(per_case)]
        proc = self.run("b", cmd)
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

    # ------------------------------------------------------------- parts c and d
    def base_overrides(self, inputs: Inputs) -> list[str]:
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
        ]

    def setup(self) -> Inputs:
        """The target directory and the chat data, shared by parts c and d (in-process)."""
        t0 = time.perf_counter()
        target_dir, data_path = self.work / "target", self.work / "chat.jsonl"
        shape, how = write_target_dir(target_dir, self.profile)
        probe_cfg = compose_config(self.base_overrides(Inputs(target_dir, data_path, 0, shape, 0)))
        sample = self.profile.prompt_tokens + self.profile.response_tokens + 12  # + chat template
        per_packet = max(1, probe_cfg.data.token_budget // sample)
        steps = max(self.profile.steps.values())
        num_samples = int(steps * per_packet * 1.25) + per_packet
        vocab_used = write_chat_data(
            data_path, target_dir, num_samples, self.profile.prompt_tokens, self.profile.response_tokens
        )
        d = probe_cfg.drafter
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
            },
            "target_dtype": probe_cfg.target.dtype,
        }
        return Inputs(target_dir, data_path, num_samples, shape, vocab_used)

    def part_c_probe(self, inputs: Inputs) -> dict[str, Any]:
        overrides = [*self.base_overrides(inputs), "topology=colocated"]
        cfg = compose_config(overrides)
        tokens = cfg.data.token_budget
        docs = self.profile.probe_docs
        spec = {"overrides": overrides, "tokens": tokens, "docs": docs, "vocab_used": inputs.vocab_used}
        t0 = time.perf_counter()
        if self.profile.inline_probe:
            res = json.loads(json.dumps(probe_target(spec)))
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-target", json.dumps(spec)]
            proc = self.run("c_probe", cmd)
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

    def train_part(self, part: str, inputs: Inputs) -> dict[str, Any]:
        colocated = part == "c"
        nproc = 1 if colocated else 2
        topo = ["topology=colocated"] if colocated else ["topology.num_targets=1", "topology.num_drafters=1"]
        steps = self.profile.steps[part]
        run_dir = self.work / f"run_{part}"
        overrides = [*self.base_overrides(inputs), *topo, f"train.max_steps={steps}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "dflash.train",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
        # Dynamo logs every recompilation (flex_attention and its block mask must compile once).
        proc = self.run(part, cmd, env={**self.env, "TORCH_LOGS": self.env.get("TORCH_LOGS", "recompiles")})
        rows = metrics_rows(run_dir)
        res: dict[str, Any] = {
            "mode": "co-located, 1 rank" if colocated else "1 target + 1 drafter",
            "backend": "gloo" if self.dry else "nccl",
            "command": "torchrun --standalone --nproc_per_node "
            + f"{nproc} -m dflash.train "
            + " ".join(
                o for o in overrides if not o.startswith(("target.path=", "data.path=", "data.cache_dir="))
            ),
            "wall_s": round(proc.seconds, 1),
            "steps_requested": steps,
            "recompiles": (proc.stdout + proc.stderr).count("Recompiling function"),
            "recompile_limit_hit": "torch._dynamo hit config." in proc.stdout + proc.stderr,
        }
        if rows:
            try:
                res.update(step_figures(rows, self.profile.warmup_steps, packets_per_step=1))
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
            res["peak_mem_gib_by_role"] = (
                {"colocated": peaks.get("0")}
                if colocated
                else {"target": peaks.get("0"), "drafter": peaks.get("1")}
            )
        if proc.timed_out or proc.rc != 0 or len(rows) != steps or "figures_error" in res:
            if proc.out_of_memory():
                res["note"] = "out of memory: lower drafter.max_anchors_per_packet or data.token_budget"
            res["rank_logs"] = {  # a worker's own traceback: torchrun's output ends with its summary
                p.stem: [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()][-25:]
                for p in sorted(run_dir.glob("rank*.log"))
            }
            status = "timeout" if proc.timed_out else "failed"
            return {**res, "status": status, "rc": proc.rc, "tail": proc.tail(20)}
        return {**res, "status": "passed"}

    def part_c(self) -> dict[str, Any]:
        inputs = self.ensure_inputs()
        probe = self.part_c_probe(inputs)
        res = self.train_part("c", inputs)
        res["target_probe"] = probe
        if "headless" in probe:  # the target role alone: its weights and one headless forward
            role = res.setdefault("peak_mem_gib_by_role", {})
            role["target_alone"] = round(probe["weights_gib"] + probe["headless"]["extra_gib"], 3)
        if probe["status"] != "passed" and res["status"] == "passed":
            res["status"] = probe["status"]
        return res

    def part_d(self) -> dict[str, Any]:
        if not self.multi_gpu:
            return {"status": "skipped", "note": f"{self.device.get('count', 0)} GPU: needs 2+", "ran": False}
        return self.train_part("d", self.ensure_inputs())

    # ------------------------------------------------------------- targets and output
    def targets(self) -> dict[str, dict[str, Any]]:
        """The "good" figures (README "GPU check"). The performance ones are judged on a GPU only
        (``met`` null in a dry run); no logits in the target's forward is judged everywhere."""
        judged = not self.dry
        b, c = self.results.get("b", {}), self.results.get("c", {})
        out: dict[str, dict[str, Any]] = {}
        best = b.get("best_chunked")
        value = best.get("peak_frac") if best else None
        out["loss_bf16_peak_frac"] = {
            "what": "chunked CE+KL loss, best chunk: useful TFLOP/s / dense bf16 peak",
            "goal": f">= {LOSS_GOAL}",
            "value": value,
            "met": (value is not None and value >= LOSS_GOAL) if judged else None,
        }
        mfu = (c.get("planner") or {}).get("drafter_mfu")
        out["drafter_mfu"] = {
            "what": "co-located drafter step: planner FLOP per packet / measured s per packet / bf16 peak",
            "goal": f">= {DRAFTER_MFU_GOAL}",
            "value": mfu,
            "met": (mfu is not None and mfu >= DRAFTER_MFU_GOAL) if judged else None,
        }
        probe = c.get("target_probe") or {}
        head = probe.get("headless") or {}
        vocab_gib = None
        if head:
            vocab_gib = 0.0 if head["vocab_tensors"] == 0 else probe["logits_gib"] * head["vocab_tensors"]
        out["target_logits_gib"] = {
            "what": "GiB of vocabulary-sized tensors the target's headless forward makes (model(...) makes "
            "one [tokens x vocab] logits tensor)",
            "goal": "0",
            "value": vocab_gib,
            "met": vocab_gib == 0.0 if head else False,
        }
        planner = c.get("planner") or {}
        peak = (c.get("peak_mem_gib_by_role") or {}).get("colocated")
        cap = planner.get("capacity_gib")
        out["colocated_memory_fits"] = {
            "what": "peak memory of the co-located rank (target + drafter) at the experiment's settings",
            "goal": f"<= {cap} GiB (HBM minus plan.reserved_gib)" if cap else "fits",
            "value": peak,
            "met": (peak is not None and cap is not None and peak <= cap) if judged else None,
        }
        return out

    def summary(self, done: bool) -> dict[str, Any]:
        ok = {p: r.get("status") in ("passed", "skipped") for p, r in self.results.items()}
        return {
            "parts": self.results,
            "targets": self.targets(),
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
        out = self.summary(done)
        if self.args.out:
            path = Path(self.args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            tmp.replace(path)
        return out

    def ensure_inputs(self) -> Inputs:
        with self.setup_lock:  # parts c and d share one target directory and data file
            if self.inputs is None:
                self.inputs = self.setup()
            return self.inputs

    def run_part(self, part: str) -> None:
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

    def main(self) -> int:
        self.detect_device()
        self.plan_budget()
        print(header(self), flush=True)
        self.t0 = time.perf_counter()  # the budgets start with the first part
        if self.concurrent:
            with ThreadPoolExecutor(max_workers=len(self.parts)) as pool:
                list(pool.map(self.run_part, self.parts))
        else:
            for part in self.parts:
                self.run_part(part)
        self.results = {p: self.results[p] for p in self.parts}
        out = self.write(done=True)
        print(render(self, out), flush=True)
        print(json.dumps(out), flush=True)
        return 0 if out["passed"] else 1


# ---------------------------------------------------------------------------------------------
# the table


def _f(x: Any, fmt: str = "{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


def header(chk: Check) -> str:
    d = chk.device
    if chk.dry:
        where = f"CPU dry run (tiny sizes, fp32; fractions of the {chk.gpu} peak are meaningless here)"
    else:
        spec = (
            f"{chk.gpu}: {chk.spec.bf16_tflops:g} dense bf16 TFLOP/s"
            if chk.spec
            else "no conf/gpu spec (--gpu)"
        )
        where = f"{d.get('name')} x{d.get('count')} ({spec}), torch {d.get('torch')}, CUDA {d.get('cuda_version')}"
    budgets = ", ".join(f"{s} {chk.profile.budgets[s]:g}" for s in chk.plan)
    skipped = [p for p in chk.parts if p == "d" and not chk.multi_gpu]
    return (
        f"dflash GPU check: {where}\n"
        f"budgets (s): {budgets}; total {chk.total_s:g} "
        + ("(parts side by side)" if chk.concurrent else "(unused time passes to the next part)")
        + (f"; part d skipped: {chk.device.get('count', 0)} GPU" if skipped else "")
        + f"\nwork dir: {chk.work}"
    )


def render(chk: Check, out: dict[str, Any]) -> str:
    bar = "-" * 100
    lines = [bar, f"{'part':<5}{'status':<9}{'time (s)':<13}figures", bar]
    budgets = out["budget_s"]
    for part, r in out["parts"].items():
        budget = budgets.get(part)
        t = f"{r.get('part_s', 0):g}" + (f"/{budget:g}" if budget else "")
        first, more = _part_lines(part, r)
        lines.append(f"{part:<5}{r['status']:<9}{t:<13}{first}")
        lines += [" " * 27 + m for m in more]
        if r["status"] not in ("passed", "skipped"):
            for m in ([r["error"]] if "error" in r else []) + r.get("errors", []) + r.get("tail", [])[-8:]:
                lines.append(" " * 27 + "| " + str(m)[:160])
    lines.append(bar)
    judged = not out["dry_run"]
    lines.append("targets" + ("" if judged else " (performance ones not judged in a dry run)") + ":")
    for name, t in out["targets"].items():
        met = {True: "MET", False: "NOT MET", None: "-"}[t["met"]]
        lines.append(f"  {name:<24}{_f(t['value']):>10}  goal {t['goal']:<42} {met}")
    lines.append(bar)
    verdict = "PASSED" if out["passed"] else "FAILED"
    lines.append(f"gpu check {verdict} in {out['wall_s']:g} s" + (" (dry run)" if chk.dry else ""))
    return "\n".join(lines)


def _part_lines(part: str, r: dict[str, Any]) -> tuple[str, list[str]]:
    if part == "a":
        c = r.get("counts", {})
        first = f"pytest -m gpu: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped, {c.get('errors', 0)} errors"
        return first + (f" ({r['note']})" if "note" in r else ""), r.get("failed_tests", [])
    if part == "b":
        more = [
            f"{'case':<12}{'terms':<7}{'chunk':>6}{'time s':>9}{'peak GB':>9}{'TFLOP/s':>9}{'of peak':>9}"
            f"{'t/naive':>9}{'m/naive':>9}{'t/limit':>9}{'t/lce':>8}"
        ]
        for c in r.get("cases", []):
            if "error" in c:
                more.append(
                    f"{c['case']:<12}{c.get('terms') or '':<7}{_f(c['chunk'], '{}'):>6}  "
                    + ("OOM" if c.get("oom") else "ERROR " + c["error"][:60])
                )
                continue
            more.append(
                f"{c['case']:<12}{c['terms']:<7}{_f(c['chunk'], '{}'):>6}{_f(c['time_s'], '{:.4f}'):>9}"
                f"{_f(c['peak_extra_gb'], '{:.3f}'):>9}{_f(c.get('tflops'), '{:.1f}'):>9}{_f(c.get('peak_frac'), '{:.3f}'):>9}"
                f"{_f(c.get('time_vs_naive'), '{:.3f}'):>9}{_f(c.get('mem_vs_naive'), '{:.3f}'):>9}"
                f"{_f(c.get('time_vs_limit'), '{:.3f}'):>9}{_f(c.get('time_vs_torch_lce'), '{:.3f}'):>8}"
            )
        more += [f"baseline not measured: {e[:140]}" for e in r.get("baseline_errors", [])]
        best = r.get("best_chunked") or {}
        first = f"loss bench ({r.get('args', '')})"
        if best:
            first = (
                f"chunked CE+KL best: chunk {best['chunk']}, {_f(best.get('tflops'), '{:.1f}')} TFLOP/s = {_f(best.get('peak_frac'), '{:.3f}')} of peak; "
                + first
            )
        return first, more
    if part in ("c", "d"):
        if r.get("status") == "skipped":
            return r.get("note", ""), []
        more = []
        probe = r.get("target_probe")
        if probe and "headless" in probe:
            h, f = probe["headless"], probe["full"]
            more.append(
                f"target probe ({probe['tokens']} tokens, {probe['dtype']}): weights {probe['weights_gib']:.2f} GiB; headless forward "
                f"+{h['extra_gib']:.2f} GiB (planner {probe['planner_activations_gib']:.2f}), largest tensor "
                f"{h['largest_tensor']['shape']}, vocab-sized tensors {h['vocab_tensors']}; model(...) +{f['extra_gib']:.2f} GiB, "
                f"vocab-sized {f['vocab_tensors']} (logits {probe['logits_gib']:.2f} GiB)"
            )
        if "steps" in r:
            s = r.get("split_s", {})
            more.append(
                f"{r['steps']}/{r['steps_requested']} steps (steady {r['steady_steps']}): {_f(r['samples_per_s'])} samples/s, "
                f"{_f(r['tokens_per_s'], '{:.0f}')} tokens/s, step {_f(r['step_s'])} s, first step {_f(r['first_step_s'])} s "
                f"(compile ~{_f(r['compile_s'])} s, {r.get('recompiles', 0)} recompiles"
                + (", RECOMPILE LIMIT HIT: eager fallback" if r.get("recompile_limit_hit") else "")
                + ")"
            )
            more.append(
                "split (s): "
                + ", ".join(f"{k.removesuffix('_s')} {_f(v)}" for k, v in s.items())
                + f"; busy {r.get('busy', {})}"
            )
            p = r.get("planner") or {}
            if p:
                more.append(
                    f"MFU (planner FLOP / measured s / {p['gpu_spec']} peak): target {_f(p['target_mfu'])} "
                    f"({_f(p['target_tflop_per_packet'])} TFLOP/packet in {_f(r['target_s_per_packet'])} s), drafter "
                    f"{_f(p['drafter_mfu'])} ({_f(p['drafter_tflop_per_packet'])} TFLOP in {_f(r['drafter_s_per_packet'])} s); "
                    f"planner at {p['planner_s_per_packet']['mfu']:g} MFU: {_f(p['planner_samples_per_s'])} samples/s"
                )
                more.append(
                    f"peak memory GiB: {r.get('peak_mem_gib_by_role')}; planner {p['memory_gib']}, capacity {p['capacity_gib']}"
                )
        return f"{r.get('mode', '')} ({r.get('backend', '')}), {r.get('wall_s', '-')} s wall" + (
            f"; {r['note']}" if "note" in r else ""
        ), more
    return "", []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dry-run", action="store_true", help="every part on CPU at tiny sizes (fp32); what CI runs"
    )
    p.add_argument(
        "--gpu", default=None, help="conf/gpu spec (h100, h200, b200, a100 or a YAML path); default: detected"
    )
    p.add_argument("--out", default=None, help="also write the JSON summary here (after every part)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of parts to run (default a,b,c,d)")
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


if __name__ == "__main__":
    main()
