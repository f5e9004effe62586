#!/usr/bin/env python
"""Benchmark of one drafter training step (``dflash.drafter.step.objective_step``: blocks, drafter
forward, chunked loss and the backward) on one packet, the ways the trainer can run it:

- ``checkpointed``  the blocks at once, ``model.checkpoint_layers`` (each decoder layer's forward
                    runs again in backward: ``drafter.activation_checkpointing=layers``);
- ``whole``         the blocks at once, no checkpointing (the fastest step, where memory allows);
- ``chunked_N``     ``drafter.block_chunks=N`` for each N in ``--chunks``: the context's keys and
                    values once, then N chunks of whole blocks, each forward + loss + backward.

The step is the trainer's: ``StepPlan.for_training`` (weighted-sum loss, ``normalizer=1``) of a config
with ``loss=<--loss>`` (``ce``: the CE recipe with the verifier metrics), its anchors drawn by
``plan_anchors`` (``ceil(anchors / docs)`` per document, at most ``--anchors`` per packet) on
``--docs`` documents of equal length packed in ``--tokens`` tokens (default ``2 x anchors``, the
recipe's density: 8,192 anchors over 16,384 tokens), each document's first eighth a prompt (no
loss); fp32 weights under the bf16 autocast on CUDA (``--dtype bf16``, the target's tensors in bf16)
or fp32 on CPU; the drafter's attention ``drafter.attention=auto``: dense-mask SDPA on CPU (flex has
no backward there), flex on CUDA padded to the static shape ``(tokens, anchors)`` with the layers
compiled (``--compile``, on by default on CUDA, as ``drafter.compile``). The drafter's shape:
``--layers`` layers as wide as the target (``--hidden``, FFN ``3 x hidden``, heads of
``--head-dim`` 128, a quarter of them key-value heads: Qwen3-8B's drafter at ``--hidden 4096``),
``--taps`` tapped layers; random inputs and frozen embedding and lm_head (``--vocab`` rows).

Every variant runs in its own process (fresh allocator, its own peak counter) on the same seeded
inputs and anchors and prints one JSON line: ``time_s``, the median of ``--repeats`` timed steps after
``--warmup`` untimed ones (``times_s`` each; ``cpu_util``: the CPU seconds the process got during them
per second and thread, below 1 where its threads waited for a core of a shared machine or for the
GPU); ``peak_extra_gib``, the memory the steps add (warm-up included): on CUDA
``max_memory_allocated`` minus the allocation once the model, inputs and anchors exist, on CPU the
process peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` at that point) minus the RSS
then; the loss and two figures of the parameters' gradient (``grad_norm``; ``grad_probe``, its dot
product with a fixed random tensor) that agree across the variants up to the summation order;
``tflop``, the step's FLOPs as the planner counts them (``dflash.sizing.costs.packet_costs``; the
attention and the loss summed chunk by chunk, and a third of the layers again when checkpointed, as
the planner models recompute). The driver (no ``--case``) first prints a ``shape`` line (the packet,
and the step's FLOPs split into the layers, their attention part and the loss;
``qwen3_8b_layers_per_loss``: the same split of the shipped ``experiment=qwen3_8b_8gpu`` step;
``vocab_same_ratio``: the ``--vocab`` that gives this shape that split), then each variant's line with
``time_vs_*`` / ``mem_vs_*`` against ``checkpointed`` and ``whole`` and
``loss_rel_diff_vs_checkpointed`` / ``grad_rel_diff_vs_checkpointed``.

Chunking saves what checkpointing recomputes, the layers' forward (a third of their FLOPs); the
loss (the lm_head GEMMs, ``2 x rows x H x V`` each, and the verifier's) is the same in every variant.
With layers L and loss S, chunked / checkpointed is at best ``(L + S) / (4/3 L + S)``: 0.85 or less
needs ``S <= 0.89 L``. Layers grow with H^2 and the loss with H x V: at H=1024, V=151,936, 2,048
anchors (flex) the loss is 61% of the step (``layers_per_loss`` 0.63, bound 0.89), for Qwen3-8B's
drafter (H=4096, 8,192 anchors) 29% (2.41, bound 0.81); ``--vocab 39727`` gives the H=1024 packet
Qwen3-8B's split (``vocab_same_ratio`` of the shape line, for any shape). Dense SDPA (CPU) computes
every context and block key of the row for each block query, so there a chunk of fewer blocks also
does less attention work (``tflop``); flex computes only the keys a block sees either way. Each
chunk's loss runs its GEMMs against the whole lm_head: chunks of a few hundred rows (small packets)
run them below the GEMMs' full rate.

    python scripts/bench_drafter_step.py --device cuda     # H=1024 V=151936, 2048 anchors / 4096 tokens
    python scripts/bench_drafter_step.py --device cuda --vocab 39727     # with Qwen3-8B's layers:loss split
    python scripts/bench_drafter_step.py --device cuda --hidden 4096 --anchors 8192 --docs 16 --chunks 2,4,8
    python scripts/bench_drafter_step.py                   # the same on CPU: dense SDPA, hours
    python scripts/bench_drafter_step.py --anchors 64 --docs 2 --threads 1 --vocab 50931  # CPU, minutes
    python scripts/bench_drafter_step.py --hidden 64 --vocab 2048 --anchors 64 --head-dim 16  # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_cases import add_ratios, run_case
from torch import Tensor

from dflash.config import Config, TargetShape
from dflash.drafter.arch import DrafterArch
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.step import PacketAnchors, StepPlan, objective_step, plan_anchors
from dflash.gpu_check.planner import training_config
from dflash.metrics import memory_gib, peak_memory_gib, reset_peak_memory, sync_current_stream
from dflash.sizing.costs import AttentionKind, PacketCosts, PacketShape, packet_costs

CASES = ("checkpointed", "whole", "chunked")
PROMPT_FRACTION = 8
"""Each document's first ``1 / PROMPT_FRACTION`` of tokens is its prompt (loss mask 0)."""
REFERENCE = ["experiment=qwen3_8b_8gpu", "data.path=unused"]
"""The shipped step whose layers:loss FLOPs split the shape line reports (its config; no data read)."""


@dataclass(frozen=True)
class Variant:
    """One way to run the step: ``chunks`` chunks of blocks, checkpointed layers or not."""

    name: str
    chunks: int
    checkpoint: bool

    @classmethod
    def parse(cls, name: str) -> Variant:
        """``checkpointed``, ``whole`` or ``chunked_<N>``."""
        if name in ("checkpointed", "whole"):
            return cls(name, 1, name == "checkpointed")
        base, _, n = name.partition("_")
        if base != "chunked" or not n.isdigit() or int(n) < 2:
            raise SystemExit(f"unknown variant {name!r}: checkpointed, whole or chunked_<N >= 2>")
        return cls(name, int(n), False)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024, help="H of the target and the drafter")
    p.add_argument("--vocab", type=int, default=151936, help="rows of the frozen embedding and lm_head")
    p.add_argument(
        "--anchors", type=int, default=2048, help="blocks per packet (drafter.max_anchors_per_packet)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=0, help="packet tokens (default 2 x anchors)")
    p.add_argument("--docs", type=int, default=8, help="documents packed in the packet")
    p.add_argument("--layers", type=int, default=5, help="drafter decoder layers")
    p.add_argument("--taps", type=int, default=5, help="tapped target layers (fc's input is taps x H)")
    p.add_argument("--head-dim", type=int, default=128, help="heads of this size, hidden / head_dim of them")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--loss", default="ce", choices=["ce", "ce_kl", "dpace"], help="the loss recipe (conf/loss)"
    )
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flex"], help="drafter.attention")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each drafter layer, as drafter.compile does (default: on CUDA)",
    )
    p.add_argument("--chunks", default="4,8", help="comma list of N for the chunked_N variants")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--repeats", type=int, default=3, help="timed steps (the median is reported)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps first (compilation, allocator), in the peak memory",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per-variant subprocess timeout (s)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.tokens = a.tokens or 2 * a.anchors
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.compile = a.device == "cuda" if a.compile is None else a.compile
    return a


def variants(a: argparse.Namespace) -> list[Variant]:
    """The variants ``--cases`` and ``--chunks`` name, in that order."""
    out = []
    for case in (c.strip() for c in a.cases.split(",") if c.strip()):
        if case not in CASES:
            raise SystemExit(f"--cases: unknown {case!r}; known {list(CASES)}")
        names = (
            [f"chunked_{int(n)}" for n in a.chunks.split(",") if n.strip()] if case == "chunked" else [case]
        )
        out += [Variant.parse(name) for name in names]
    return out


# ---------------------------------------------------------------------------------------------
# the step, its shape and its FLOPs


def target_shape(a: argparse.Namespace) -> TargetShape:
    """The target's shape the drafter takes its width from (Qwen3 proportions: FFN 3 x H, a quarter
    of the heads key-value heads); its own layer count does not enter the drafter step."""
    heads = max(1, a.hidden // a.head_dim)
    return TargetShape(
        num_layers=a.taps,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        head_dim=a.head_dim,
        vocab_size=a.vocab,
    )


def drafter_arch(shape: TargetShape, layers: int, taps: int, block_size: int) -> DrafterArch:
    """A DFlash-1 drafter of ``layers`` full-attention layers as wide as ``shape`` on ``taps`` taps."""
    return DrafterArch(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        target_layer_ids=list(range(taps)),
        block_size=block_size,
        mask_token_id=shape.vocab_size - 1,
    )


def step_config(a: argparse.Namespace) -> Config:
    """The training config of the benchmark's step (loss recipe, attention, dtype, anchors, seed)."""
    return training_config(
        [
            f"loss={a.loss}",
            f"drafter.attention={a.attention}",
            f"drafter.dtype={'bfloat16' if a.dtype == 'bf16' else 'float32'}",
            f"drafter.block_size={a.block_size}",
            f"drafter.num_anchors={-(-a.anchors // a.docs)}",
            f"drafter.max_anchors_per_packet={a.anchors}",
            f"train.seed={a.seed}",
        ]
    )


def step_plan(a: argparse.Namespace, cfg: Config, chunks: int) -> StepPlan:
    """The trainer's step plan of ``cfg`` on ``--device`` for packets of ``--tokens``, in ``chunks``."""
    return StepPlan.for_training(
        cfg, a.block_size, device=a.device, token_budget=a.tokens, block_chunks=chunks
    )


def host_packet(a: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """``(seq_lens [docs], loss_mask [tokens])`` on the host: equal documents, each with its prompt."""
    seq_lens = torch.tensor([len(d) for d in torch.arange(a.tokens).tensor_split(a.docs)])
    mask = torch.cat([(torch.arange(int(n)) >= int(n) // PROMPT_FRACTION).long() for n in seq_lens])
    return seq_lens, mask


def packet_anchors_of(a: argparse.Namespace, plan: StepPlan) -> PacketAnchors:
    """The packet's anchors as the trainer draws them (``plan_anchors`` of packet 0)."""
    seq_lens, mask = host_packet(a)
    return plan_anchors(plan, seq_lens, mask, 0)


def step_costs(
    a: argparse.Namespace, plan: StepPlan, blocks: int, computed: int, rows: int = 0, verifier: int = 0
) -> PacketCosts:
    """``packet_costs`` of ``blocks`` real blocks computed as ``computed`` (padded to a static shape)
    in one batch under ``plan``, with ``rows`` supervised slots at ``verifier`` distinct verifier
    positions."""
    shape = target_shape(a)
    packet = PacketShape(
        tokens=a.tokens,
        num_seqs=a.docs,
        num_anchors=blocks,
        loss_rows=rows,
        verifier_rows=verifier,
        drafter_blocks=computed,
    )
    arch = drafter_arch(shape, a.layers, a.taps, a.block_size)
    kind: AttentionKind = "sparse" if plan.attention == "flex" else "dense"
    return packet_costs(shape, arch, packet, plan.loss, target_attention="sparse", drafter_attention=kind)


def static_chunk(plan: StepPlan, anchors: PacketAnchors) -> int:
    """The blocks each chunk is padded to (the static shape's, for flex); 0: none, each its own."""
    return plan.chunk_anchors(int(anchors.anchors.shape[1])) if plan.static_shape is not None else 0


def chunk_costs(a: argparse.Namespace, plan: StepPlan, anchors: PacketAnchors) -> list[PacketCosts]:
    """The costs of each chunk of ``anchors`` (one when unchunked) as computed: its real blocks (padded
    with flex), its supervised rows and their verifier positions."""
    static = static_chunk(plan, anchors)
    out = []
    for chunk, rows in anchors.chunks:
        blocks = int((chunk >= 0).sum())
        verifier = int(torch.unique_consecutive(rows).numel())
        out.append(step_costs(a, plan, blocks, static or blocks, int(rows.numel()), verifier))
    return out


def packet_step_costs(a: argparse.Namespace, plan: StepPlan, anchors: PacketAnchors) -> PacketCosts:
    """The costs of the packet's blocks and supervised rows as one batch of every block computed."""
    static = static_chunk(plan, anchors)
    computed = static * len(anchors.chunks) if static else anchors.num_blocks
    return step_costs(a, plan, anchors.num_blocks, computed, anchors.num_rows, anchors.verifier_rows)


def variant_flop(a: argparse.Namespace, plan: StepPlan, anchors: PacketAnchors, checkpoint: bool) -> float:
    """The step's FLOPs: the whole packet's layers but their attention, and each chunk's attention
    and loss (a chunk sees its own blocks; the verifier positions two chunks share run in both), plus
    a third of the layers when they are recomputed (as the planner counts recompute)."""
    whole = packet_step_costs(a, plan, anchors)
    chunks = sum(c.drafter_attention_flop + c.drafter_loss_total for c in chunk_costs(a, plan, anchors))
    recompute = whole.drafter_layers_flop / 3 if checkpoint else 0.0
    return whole.drafter_layers_flop - whole.drafter_attention_flop + chunks + recompute


def reference_layers_per_loss() -> float:
    """Layers : loss FLOPs of the shipped Qwen3-8B drafter step (``experiment=qwen3_8b_8gpu``: its
    anchors cap over ``data.token_budget`` tokens, ``num_anchors`` per document, flex)."""
    cfg = training_config(REFERENCE)
    d = cfg.drafter
    shape = cfg.target.shape
    assert shape is not None and d.max_anchors_per_packet is not None
    arch = drafter_arch(shape, d.num_layers, len(cfg.target.layer_ids or []), d.block_size)
    packet = PacketShape(
        tokens=cfg.data.token_budget,
        num_seqs=d.max_anchors_per_packet // d.num_anchors,
        num_anchors=d.max_anchors_per_packet,
    )
    c = packet_costs(shape, arch, packet, cfg.loss, target_attention="sparse", drafter_attention="sparse")
    return c.drafter_layers_flop / c.drafter_loss_total


def shape_record(a: argparse.Namespace) -> dict:
    """The packet and the unchunked step's FLOPs split; the vocabulary that gives Qwen3-8B's split."""
    plan = step_plan(a, step_config(a), 1)
    anchors = packet_anchors_of(a, plan)
    c = packet_step_costs(a, plan, anchors)
    reference = reference_layers_per_loss()
    layers, loss = c.drafter_layers_flop, c.drafter_loss_total
    return {
        "hidden": a.hidden,
        "vocab": a.vocab,
        "layers": a.layers,
        "tokens": a.tokens,
        "docs": a.docs,
        "blocks": anchors.num_blocks,
        "rows": anchors.num_rows,
        "verifier_rows": anchors.verifier_rows,
        "attention": str(plan.attention),
        "layers_tflop": round(layers / 1e12, 4),
        "attention_tflop": round(c.drafter_attention_flop / 1e12, 4),
        "loss_tflop": round(loss / 1e12, 4),
        "loss_share": round(loss / (layers + loss), 4),
        "layers_per_loss": round(layers / loss, 4),
        "qwen3_8b_layers_per_loss": round(reference, 4),
        "vocab_same_ratio": round(a.vocab * layers / (reference * loss)),
    }


# ---------------------------------------------------------------------------------------------
# one variant (child process)


def device_inputs(a: argparse.Namespace, arch: DrafterArch, device: torch.device) -> dict[str, Tensor]:
    """Seeded inputs on ``device``: ids [T], taps [T, taps*H], final states [T, H] and the frozen
    embedding and lm_head [V, H] (logits of about unit scale) in the target's dtype."""
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device=device).manual_seed(a.seed)
    T, H, V = a.tokens, arch.hidden_size, arch.vocab_size

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    return {
        "ids": torch.randint(0, V - 1, (T,), generator=g, device=device),
        "aux": randn(T, arch.num_taps * H),
        "final": randn(T, H),
        "embed": randn(V, H),
        "head": randn(V, H, scale=H**-0.5),
    }


def grad_figures(model: torch.nn.Module, seed: int) -> tuple[float, float]:
    """``(norm, probe)`` of the parameters' gradient: its norm and its dot product with a fixed
    random tensor (the same for every variant: parameters in their order, one seeded draw each)."""
    g = torch.Generator().manual_seed(seed + 1)
    norm2 = probe = 0.0
    for p in model.parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if p.grad is not None:
            grad = p.grad.detach().to("cpu", torch.float64)
            norm2 += float(grad.square().sum())
            probe += float((grad * r).sum())
    return norm2**0.5, probe


def measure(a: argparse.Namespace, v: Variant) -> dict:
    """Run variant ``v``'s step ``--warmup`` + ``--repeats`` times; its JSON record."""
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = step_config(a)
    plan = step_plan(a, cfg, v.chunks)
    arch = drafter_arch(target_shape(a), a.layers, a.taps, a.block_size)
    model = DFlashDraftModel(arch)
    model.reset_parameters(seed=a.seed)
    model.checkpoint_layers = v.checkpoint
    if a.compile:
        model.compile_layers(dynamic=False if plan.attention == "flex" else None)
    model.to(device)
    x = device_inputs(a, arch, device)
    mask = host_packet(a)[1].to(device)
    anchors = packet_anchors_of(a, plan)

    def step() -> Tensor:
        model.zero_grad(set_to_none=False)
        out = objective_step(
            model, x["embed"], x["head"], x["aux"], x["final"], x["ids"], mask, anchors, plan
        )
        out.loss.backward()
        return out.loss.detach()

    sync_current_stream(device)
    reset_peak_memory(device)
    base = memory_gib(device)
    for _ in range(a.warmup):
        step()
    times = []
    cpu0 = time.process_time()
    for _ in range(a.repeats):
        sync_current_stream(device)
        t0 = time.perf_counter()
        loss = step()
        sync_current_stream(device)
        times.append(time.perf_counter() - t0)
    cpu_util = (time.process_time() - cpu0) / (sum(times) * torch.get_num_threads())
    peak = peak_memory_gib(device) - base
    norm, probe = grad_figures(model, a.seed)
    seconds = statistics.median(times)
    tflop = variant_flop(a, plan, anchors, v.checkpoint) / 1e12
    rec = {
        "case": v.name,
        "chunks": v.chunks,
        "checkpoint": v.checkpoint,
        "blocks": anchors.num_blocks,
        "rows": anchors.num_rows,
        "device": a.device,
        "dtype": a.dtype,
        "attention": str(plan.attention),
        "compiled": a.compile,
        "threads": torch.get_num_threads(),
        "time_s": round(seconds, 4),
        "times_s": [round(t, 4) for t in times],
        "cpu_util": round(cpu_util, 3),
        "peak_extra_gib": round(peak, 4),
        "loss": float(loss),
        "grad_norm": norm,
        "grad_probe": probe,
        "tflop": round(tflop, 4),
    }
    if device.type == "cuda":
        rec.update(tflops=round(tflop / seconds, 2), gpu=torch.cuda.get_device_name(device))
    return rec


# ---------------------------------------------------------------------------------------------
# driver


def run_variant(a: argparse.Namespace, argv: list[str], v: Variant) -> dict:
    """Variant ``v`` in a process of its own: its record, or ``{case, error}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--case", v.name]
    return run_case(cmd, a.timeout, {"case": v.name})


def add_differences(r: dict, ref: dict | None) -> None:
    """The loss's and the gradient probe's relative differences from ``ref`` (checkpointed)."""
    if ref is None or "error" in ref:
        return
    for key, field in (("loss", "loss"), ("grad", "grad_probe")):
        r[f"{key}_rel_diff_vs_checkpointed"] = abs(r[field] - ref[field]) / max(abs(ref[field]), 1e-30)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = _parse(argv)
    if a.case is not None:
        print(json.dumps(measure(a, Variant.parse(a.case))), flush=True)
        return
    plan = variants(a)
    print(json.dumps({"shape": shape_record(a)}), flush=True)
    results = []
    for v in plan:
        results.append(run_variant(a, argv, v))
        print(json.dumps({"progress": results[-1]}), file=sys.stderr, flush=True)
    by_case = {r["case"]: r for r in results}
    for r in results:
        if "error" not in r:
            add_ratios(r, by_case.get("checkpointed"), "checkpointed", "peak_extra_gib")
            add_ratios(r, by_case.get("whole"), "whole", "peak_extra_gib")
            add_differences(r, by_case.get("checkpointed"))
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
