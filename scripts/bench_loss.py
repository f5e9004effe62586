#!/usr/bin/env python
"""Benchmark of the chunked verifier-logit loss (``dflash.loss.verifier``) against the alternatives.

Every case runs in its own process (fresh allocator, its own peak-memory counter) on the same seeded
inputs (drawn on the device with ``--device cuda``), and prints one JSON line; the driver (no
``--case``) spawns them and prints, per case, the line completed with ratios:

- ``chunked``      verifier_loss, ``--terms`` ce+kl (ce=1, kl=1, T=1) at each ``--chunks`` size;
- ``chunked_ce``   verifier_loss, ce only (no verifier GEMM);
- ``chunked_dpace`` verifier_loss, ce with D-PACE weights (``loss.dpace=0.5``) over blocks of 16
                   slots (15 supervised rows each): its cost beside ``chunked_ce`` (``*_vs_ce``);
- ``naive``        full verifier logits, ``roll``, full drafter logits, ``log_softmax``, autograd;
- ``naive_ce``     full drafter logits + ``F.cross_entropy``, autograd;
- ``torch_lce``    ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(batch_chunk_size=C))``;
- ``per_row`` / ``per_position`` (and ``*_ce``): the rows of real blocks, ``rows / 15`` anchors
                   of 16 slots drawn over ``--positions`` positions (default ``2 * anchors``, the
                   recipe's density: 8,192 anchors over 16,384 tokens), rows in position order as
                   ``dflash_loss`` passes them, ``[positions, H]`` verifier hidden states; the verifier
                   rows gathered per row (``per_row``, the loss before the verifier work was shared)
                   or ``verifier_index`` (``per_position``: the verifier's work once per distinct
                   position). ``*_ce`` is the CE recipe with the verifier metrics (ce=1, kl=0); the
                   others ce+kl. ``per_position*`` add ``time_vs_per_row`` / ``mem_vs_per_row``;
- ``limit``        only the GEMMs of the chunked ce+kl loss (3 x 2RHV: verifier and drafter logits,
                   dh = G @ W) into preallocated fp32 buffers at chunk C: this machine's matmul limit;
- ``limit_ce``     the same with the 2 GEMMs of ce only.

Time: best of ``--repeats`` forward+backward runs after ``--warmup`` untimed ones (default 1).
Values: every case but ``limit*`` reports the loss of its last run and two figures of the gradient it
left on the drafter hidden states (``grad_norm``, and ``grad_probe``: its dot product with a fixed
random tensor), so that cases of the same terms can be checked against each other (same inputs).
Memory (warm-up included): on CUDA ``max_memory_allocated`` minus the allocation after the inputs
exist; on CPU the process peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` after the inputs exist) minus the RSS at that point. Ratios:
``time_vs_naive`` / ``mem_vs_naive`` against the naive case of the same terms, ``time_vs_limit``
against the best ``limit`` (over chunk sizes) of the same terms, ``*_vs_torch_lce`` for ce only at
the same chunk size. On CUDA ``tflops`` counts the useful 2RHV per GEMM (6RHV for ce+kl, 4RHV for ce).

    python scripts/bench_loss.py                       # CPU default: R=4096 H=256 V=151936 fp32
    python scripts/bench_loss.py --rows 512 --repeats 2 --cases chunked,limit
    python scripts/bench_loss.py --device cuda --dtype bf16 --rows 32768 --hidden 4096 --chunks 1024,4096,8192
    python scripts/bench_loss.py --hidden 1024 --rows 1920 --chunks 1024 --repeats 1 \
        --cases per_row,per_position,per_row_ce,per_position_ce   # verifier per row vs per position

``scripts/gpu_check.py`` runs it (part b) and adds the fraction of the GPU's bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_cases import add_ratios, run_case

REPO = Path(__file__).resolve().parents[1]
POSITION_CASES = ["per_row", "per_position", "per_row_ce", "per_position_ce"]
ALL_CASES = [
    "limit",
    "limit_ce",
    "chunked",
    "chunked_ce",
    "chunked_dpace",
    "torch_lce",
    "naive",
    "naive_ce",
    *POSITION_CASES,
]
CHUNKED_CASES = {"limit", "limit_ce", "chunked", "chunked_ce", "chunked_dpace", "torch_lce", *POSITION_CASES}
CE_ONLY = {"limit_ce", "chunked_ce", "chunked_dpace", "torch_lce", "naive_ce"}
DPACE_BLOCK = 16
MEM = "peak_extra_gb"
"""The records' memory figure (``add_ratios``)."""
BLOCK = 16  # slots of a block of the per_row / per_position cases (15 supervised rows each)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp64"])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--terms",
        default="ce+kl,ce",
        help="comma list of ce+kl and/or ce: which loss families to run (default both)",
    )
    p.add_argument("--chunks", default="1024,256", help="comma list of chunk sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs before the timed ones (first-touch page faults, allocator and BLAS warm-up; "
        "a training step is never the first call), counted in the peak memory",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the usable cores)")
    p.add_argument("--cases", default=",".join(ALL_CASES), help="comma list of cases to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--positions",
        type=int,
        default=0,
        help="per_row / per_position: positions the blocks are drawn over (default 2 x anchors)",
    )
    p.add_argument("--logit-std", type=float, default=3.0, help="std of the random logits")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-case subprocess timeout (s)")
    p.add_argument(
        "--inline",
        action="store_true",
        help="run every case in this process, one after the other (smoke runs at tiny sizes, e.g. "
        "scripts/gpu_check.py --dry-run: one interpreter start instead of one per case; the memory "
        "figures then include the earlier cases and mean nothing)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="shared CPU machines: before each case, and before each timed repeat (up to 120 s), wait "
        "(up to this many seconds) until the machine has been idle (< 20%% busy) for 3 s",
    )
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# one case (child process)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_stat() -> list[int] | None:
    """Aggregate /proc/stat cpu counters (user nice system idle iowait irq softirq steal ...)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None


def _busy_frac(interval: float) -> float:
    s0 = _cpu_stat()
    time.sleep(interval)
    s1 = _cpu_stat()
    if not s0 or not s1:
        return 0.0
    d = [y - x for x, y in zip(s0, s1, strict=False)][:8]
    return 1 - (d[3] + d[4]) / (sum(d) or 1)


def _settle(max_wait: float) -> float:
    """Wait until the machine has been idle for 3 consecutive seconds (or ``max_wait`` passed)."""
    t0 = time.time()
    quiet = 0
    while time.time() - t0 < max_wait and quiet < 3:
        quiet = quiet + 1 if _busy_frac(1.0) < 0.2 else 0
    return round(time.time() - t0, 1)


def _run_case(a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    threads = a.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    dev = torch.device(a.device)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[a.dtype]
    cuda = dev.type == "cuda"
    R, H, V, C = a.rows, a.hidden, a.vocab, a.chunk
    blocks = positions = 0
    if a.case in POSITION_CASES:
        blocks = R // (BLOCK - 1)
        R = blocks * (BLOCK - 1)
        positions = a.positions or 2 * blocks
        if blocks < 1 or positions < blocks + BLOCK - 1:
            raise SystemExit(f"--positions {positions} cannot hold {blocks} blocks of {BLOCK} slots")

    # On CUDA the inputs are drawn on the device: at R=32768, H=4096, V=151936 a CPU draw takes
    # seconds per case (each case is its own process), a device draw milliseconds.
    gen_dev = dev if cuda else torch.device("cpu")
    g = torch.Generator(device=gen_dev).manual_seed(a.seed)
    w_head = (torch.randn(V, H, generator=g, device=gen_dev) * (a.logit_std / H**0.5)).to(dev, dt)
    h_d = torch.randn(R, H, generator=g, device=gen_dev).to(dev, dt).requires_grad_()
    h_v = torch.randn(R, H, generator=g, device=gen_dev).to(dev, dt)
    labels = torch.randint(0, V, (R,), generator=g, device=gen_dev).to(dev)
    weights = torch.ones(R, device=dev)  # uniform: comparable with F.linear_cross_entropy's mean
    ce_only = a.case in CE_ONLY
    kl = 0.0 if ce_only else 1.0

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    last: dict[str, torch.Tensor] = {}  # the loss of the latest run of step()

    if a.case in ("limit", "limit_ce"):
        cdt = torch.float64 if dt == torch.float64 else torch.float32
        w_mm = w_head if (cuda or dt == cdt) else w_head.to(cdt)
        zbuf = torch.empty(min(C, R), V, device=dev, dtype=cdt)
        dh_buf = torch.empty(min(C, R), H, device=dev, dtype=cdt)

        def mm(x, y, out):
            if x.dtype == out.dtype and y.dtype == out.dtype:
                return torch.mm(x, y, out=out)
            if cuda:
                return torch.mm(x, y, out_dtype=out.dtype, out=out)
            return torch.mm(x.to(out.dtype), y.to(out.dtype), out=out)

        def step():
            with torch.no_grad():
                for c0 in range(0, R, C):
                    n = min(C, R - c0)
                    z = zbuf[:n]
                    if not ce_only:
                        mm(h_v[c0 : c0 + n], w_mm.t(), z)
                    mm(h_d[c0 : c0 + n], w_mm.t(), z)
                    if cuda and w_mm.dtype != cdt:
                        mm(z.to(w_mm.dtype), w_mm, dh_buf[:n])
                    else:
                        torch.mm(z, w_mm, out=dh_buf[:n])
    elif a.case in ("chunked", "chunked_ce"):
        sys.path.insert(0, str(REPO))
        from dflash.loss.verifier import verifier_loss

        def step():
            h_d.grad = None
            out = verifier_loss(
                h_d, None if ce_only else h_v, w_head, labels, weights, ce=1.0, kl=kl, chunk_size=C
            )
            out.loss.backward()
            last["loss"] = out.loss.detach()
    elif a.case == "chunked_dpace":
        sys.path.insert(0, str(REPO))
        from dflash.loss.dpace import dpace_weights
        from dflash.loss.verifier import verifier_loss

        blocks = -(-R // (DPACE_BLOCK - 1))
        supervised = torch.zeros(blocks, DPACE_BLOCK, dtype=torch.bool, device=dev)
        supervised[:, 1:] = True
        slot = torch.arange(R, device=dev)
        slot = (slot // (DPACE_BLOCK - 1)) * DPACE_BLOCK + slot % (DPACE_BLOCK - 1) + 1
        supervised.view(-1)[slot.max() + 1 :] = False

        def reweight(losses):
            full = torch.zeros(blocks * DPACE_BLOCK, dtype=losses.dtype, device=losses.device)
            full[slot] = losses
            return dpace_weights(full.view(blocks, DPACE_BLOCK), supervised, 0.5).view(-1)[slot]

        def step():
            h_d.grad = None
            out = verifier_loss(h_d, None, w_head, labels, weights, ce=1.0, chunk_size=C, reweight=reweight)
            out.loss.backward()
            last["loss"] = out.loss.detach()
    elif a.case in POSITION_CASES:
        sys.path.insert(0, str(REPO))
        from dflash.loss.verifier import verifier_loss

        g_cpu = torch.Generator().manual_seed(a.seed + 2)
        anchors = torch.randperm(positions - BLOCK + 1, generator=g_cpu)[:blocks]
        # slot k = 1..15 of the block at anchor a reads the verifier row a + k - 1; rows in position order
        index = (anchors[:, None] + torch.arange(BLOCK - 1)).reshape(-1).sort().values
        final = torch.randn(positions, H, generator=g_cpu).to(dev, dt)
        index_dev = index.to(dev)
        kl = 0.0 if a.case.endswith("_ce") else 1.0
        shared = a.case.startswith("per_position")

        def step():
            h_d.grad = None
            hv = final if shared else final[index_dev]  # the per-row gather is part of the old step
            out = verifier_loss(
                h_d,
                hv,
                w_head,
                labels,
                weights,
                ce=1.0,
                kl=kl,
                chunk_size=C,
                verifier_index=index if shared else None,
            )
            out.loss.backward()
            last["loss"] = out.loss.detach()
    elif a.case == "torch_lce":
        from torch.nn import LinearCrossEntropyOptions

        opts = LinearCrossEntropyOptions(batch_chunk_size=C, chunking_method=None)

        def step():
            h_d.grad = None
            loss = F.linear_cross_entropy(h_d, w_head, labels, options=opts)
            loss.backward()
            last["loss"] = loss.detach()
    elif a.case in ("naive", "naive_ce"):
        h_v_shift = torch.roll(h_v, -1, 0)  # the naive path rolls full-size logits back into place

        def step():
            h_d.grad = None
            zd = (h_d @ w_head.t()).float()
            logq = F.log_softmax(zd, dim=-1)
            ce = F.nll_loss(logq, labels, reduction="none")
            per_row = ce
            if not ce_only:
                with torch.no_grad():
                    zv = torch.roll((h_v_shift @ w_head.t()).float(), 1, 0)
                    logp = F.log_softmax(zv, dim=-1)
                    p = logp.exp()
                klr = (p * (logp - logq)).sum(-1)
                per_row = per_row + kl * klr
            loss = (weights * per_row).sum() / weights.sum()
            loss.backward()
            last["loss"] = loss.detach()
    else:
        raise SystemExit(f"unknown case {a.case}")

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _rss_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            hwm_ok = True
        except OSError:
            hwm_ok = False
    for _ in range(a.warmup):
        step()
    sync()
    times = []
    busy = [0] * 10
    settle_each = min(a.settle, 120.0)  # per repeat: wait for an idle machine (shared CPU boxes)
    for _ in range(a.repeats):
        if settle_each > 0 and not cuda:
            _settle(settle_each)
        st0 = _cpu_stat()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        st1 = _cpu_stat()
        if st0 and st1:
            busy = [b + y - x for b, x, y in zip(busy, st0, st1, strict=False)]
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        import resource

        hwm = _rss_bytes("VmHWM") if hwm_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = hwm - base
    best = min(times)
    n_gemm = 2 if ce_only else 3
    rec = {
        "case": a.case,
        "terms": "ce" if ce_only or a.case.endswith("_ce") else "ce+kl",
        "chunk": C if a.case in CHUNKED_CASES else None,
        "rows": R,
        "hidden": H,
        "vocab": V,
        "dtype": a.dtype,
        "device": str(dev),
        "threads": threads,
        "time_s": round(best, 4),
        "times_s": [round(t, 4) for t in times],
        "warmup": a.warmup,
        "peak_extra_gb": round(peak / 1e9, 4),
        "gemm_tflops": round(2 * n_gemm * R * H * V / best / 1e12, 4),
    }
    if sum(busy[:8]):
        tot = sum(busy[:8])
        # machine-wide busy share (this process included) and hypervisor steal during the timed runs
        rec["cpu_busy_frac"] = round(1 - (busy[3] + busy[4]) / tot, 3)
        rec["cpu_steal_frac"] = round(busy[7] / tot, 3)
    if "loss" in last and h_d.grad is not None:
        grad = h_d.grad.double()
        probe = torch.randn(R, H, generator=torch.Generator().manual_seed(a.seed + 1), dtype=torch.float64)
        rec["loss"] = last["loss"].item()
        rec["grad_norm"] = grad.norm().item()
        rec["grad_probe"] = (grad * probe.to(dev)).sum().item()
    if a.case in POSITION_CASES:
        rec.update(blocks=blocks, positions=positions, verifier_positions=int(index.unique().numel()))
    if cuda:
        rec["tflops_6rhv"] = round(6 * R * H * V / best / 1e12, 2)
        rec["gpu"] = torch.cuda.get_device_name(dev)
    return rec


# ---------------------------------------------------------------------------------------------
# driver


def main() -> None:
    a = _parse()
    if a.case is not None:
        print(json.dumps(_run_case(a)), flush=True)
        return
    terms = {t.strip() for t in a.terms.split(",") if t.strip()}
    bad = terms - {"ce+kl", "ce"}
    if bad:
        raise SystemExit(f"--terms: unknown {sorted(bad)} (use ce+kl and/or ce)")
    chunks = [int(c) for c in a.chunks.split(",") if c.strip()]
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        if c not in ALL_CASES:
            raise SystemExit(f"--cases: unknown {c!r}; known {ALL_CASES}")
    plan = []
    for c in cases:
        t = "ce" if c in CE_ONLY or c.endswith("_ce") else "ce+kl"
        if t not in terms and c not in POSITION_CASES:
            continue
        plan += [(c, k) for k in chunks] if c in CHUNKED_CASES else [(c, 0)]
    base_args = [
        "--rows",
        str(a.rows),
        "--hidden",
        str(a.hidden),
        "--vocab",
        str(a.vocab),
        "--dtype",
        a.dtype,
        "--device",
        a.device,
        "--repeats",
        str(a.repeats),
        "--warmup",
        str(a.warmup),
        "--threads",
        str(a.threads),
        "--seed",
        str(a.seed),
        "--logit-std",
        str(a.logit_std),
        "--settle",
        str(a.settle),
        "--positions",
        str(a.positions),
    ]
    results = []
    for case, chunk in plan:
        waited = _settle(a.settle) if a.settle > 0 else None
        if a.inline:
            try:
                rec = _run_case(argparse.Namespace(**{**vars(a), "case": case, "chunk": chunk}))
            except Exception as e:  # one case's failure is reported, the others still run
                rec = {"case": case, "chunk": chunk or None, "error": f"{type(e).__name__}: {e}"}
            results.append(rec)
            print(json.dumps({"progress": rec}), file=sys.stderr, flush=True)
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *base_args,
            "--case",
            case,
            "--chunk",
            str(chunk),
        ]
        rec = run_case(cmd, a.timeout, {"case": case, "chunk": chunk or None})
        if waited is not None:
            rec["settle_wait_s"] = waited
        results.append(rec)
        print(json.dumps({"progress": rec}), file=sys.stderr, flush=True)

    ok = [r for r in results if "error" not in r]

    def find(case, chunk=None):
        for r in ok:
            if r["case"] == case and (chunk is None or r.get("chunk") == chunk):
                return r
        return None

    limits = {
        t: min(
            (r["time_s"] for r in ok if r["case"] == ("limit" if t == "ce+kl" else "limit_ce")), default=None
        )
        for t in ("ce+kl", "ce")
    }
    for r in results:
        if "error" in r:
            print(json.dumps(r), flush=True)
            continue
        t = r["terms"]
        naive = find("naive" if t == "ce+kl" else "naive_ce")
        if r is not naive:
            add_ratios(r, naive, "naive", MEM)
        if limits[t] and not r["case"].startswith("limit"):
            r["time_vs_limit"] = round(r["time_s"] / limits[t], 4)
        if r["case"] == "chunked_dpace":
            add_ratios(r, find("chunked_ce", r["chunk"]), "ce", MEM)
        if r["case"] == "chunked_ce":
            add_ratios(r, find("torch_lce", r["chunk"]), "torch_lce", MEM)
        if r["case"].startswith("per_position"):
            add_ratios(r, find(r["case"].replace("per_position", "per_row"), r["chunk"]), "per_row", MEM)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
