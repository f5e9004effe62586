"""The GPU a plan is for (``plan.gpu``): a shipped profile of ``conf/gpu/``, a YAML file, or ``auto``
(this host's device), with ``plan.gpu_spec.<field>`` replacing any of its figures.

``auto`` reads the device's name and memory from torch, takes the datasheet figures (peak, memory
bandwidth, network) of the profile whose ``match`` the name holds, and probes the links: peer access
between GPUs 0 and 1, and a timed copy between them (NVLink-class above :data:`NVLINK_GBPS_ABOVE`
one way). A device no profile matches gets its bf16 GEMM rate and memory bandwidth measured (a
measured peak is below the datasheet's, so MFU applies on top of an already lower figure: the plan
errs slow). The probe takes a few seconds and allocates under 2 GiB per GPU.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from omegaconf import OmegaConf

from dflash.config import Config, GpuFields, GpuSpec, PlanConfig
from dflash.plan.links import link_problems
from dflash.sizing.inputs import PlanInputs, model_inputs

GPU_DIR = Path(__file__).resolve().parent.parent.parent / "conf" / "gpu"
AUTO = "auto"
NVLINK_GBPS_ABOVE = 100.0
"""A GPU-to-GPU copy faster than this (GB/s, one way) is taken to run over NVLink."""


def profiles() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.yaml"))


def _path(name: str) -> Path:
    return Path(name).expanduser() if name.endswith((".yaml", ".yml")) else GPU_DIR / f"{name}.yaml"


def gpu_problems(p: PlanConfig, cuda_available: bool | None = None) -> list[str]:
    """What is wrong with ``plan.gpu`` and ``plan.gpu_spec``, each naming the fix (no probe runs)."""
    if p.gpu == AUTO:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            return [
                f"plan.gpu=auto needs a CUDA device on this host; name one instead: plan.gpu=<{', '.join(profiles())}>"
            ]
        return []
    if not _path(p.gpu).is_file():
        return [
            f"plan.gpu={p.gpu}: no {_path(p.gpu)}; use one of {', '.join(profiles())}, auto, or a YAML file"
        ]
    try:
        spec = with_fields(load_gpu(p.gpu), p.gpu_spec)
    except Exception as e:  # a YAML file with a wrong or missing field
        return [f"plan.gpu={p.gpu}: {e}".splitlines()[0]]
    return spec_problems(spec, p) or link_problems(spec, f"plan.gpu={p.gpu}")


POSITIVE = ("bf16_tflops", "hbm_tbps", "internode_gbps")
"""GPU figures that must be finite and > 0 (the others finite and >= 0)."""


def spec_problems(spec: GpuSpec, p: PlanConfig) -> list[str]:
    """Figures no GPU has (NaN, infinite, negative, a zero rate, memory not above ``plan.reserved_gib``),
    each naming the ``plan.gpu_spec`` field and the range."""
    out = []
    for f in dataclasses.fields(GpuFields):
        value = getattr(spec, f.name)
        if f.name in ("name", "p2p") or not isinstance(value, int | float):
            continue
        least = 1 if f.name == "gpus_per_node" else 0
        strict = f.name in POSITIVE
        if not math.isfinite(value) or value < least or (strict and value <= 0):
            bound = "> 0" if strict else f">= {least}"
            out.append(f"plan.gpu_spec.{f.name}={value} (plan.gpu={p.gpu}): must be a finite number {bound}")
    hbm = spec.hbm_gb
    if math.isfinite(hbm) and math.isfinite(p.reserved_gib) and hbm * 1e9 / 2**30 <= p.reserved_gib:
        out.append(
            f"plan.gpu_spec.hbm_gb={hbm} (plan.gpu={p.gpu}): {hbm * 1e9 / 2**30:.1f} GiB leaves nothing above "
            f"plan.reserved_gib={p.reserved_gib}; give the GPU's memory in GB (e.g. plan.gpu_spec.hbm_gb=80)"
        )
    return out


def load_gpu(name: str) -> GpuSpec:
    """``conf/gpu/<name>.yaml`` or a YAML file path, validated as GpuSpec."""
    path = _path(name)
    if not path.is_file():
        raise ValueError(f"plan.gpu={name!r}: no {path}; use one of {profiles()} or a path to a YAML file")
    spec = OmegaConf.merge(OmegaConf.structured(GpuSpec), OmegaConf.load(path))
    obj = OmegaConf.to_object(spec)
    assert isinstance(obj, GpuSpec)
    return obj


def with_fields(spec: GpuSpec, fields: GpuFields) -> GpuSpec:
    """``spec`` with every field ``fields`` sets replaced."""
    given = {k: v for k, v in dataclasses.asdict(fields).items() if v is not None}
    return dataclasses.replace(spec, **given)


def match_profile(device_name: str) -> str | None:
    """The profile whose ``match`` (or stem) is the longest part of ``device_name``, else None."""
    low = device_name.lower()
    best: tuple[int, str] | None = None
    for name in profiles():
        for pattern in [name, *load_gpu(name).match]:
            if pattern.lower() in low and (best is None or len(pattern) > best[0]):
                best = (len(pattern), name)
    return best[1] if best else None


def plan_gpu(p: PlanConfig) -> tuple[GpuSpec, str]:
    """The GPU of ``plan.gpu`` with ``plan.gpu_spec`` applied, and a line saying where it came from."""
    if p.gpu != AUTO:
        return with_fields(load_gpu(p.gpu), p.gpu_spec), f"plan.gpu={p.gpu}"
    spec, source = detect_gpu()
    return with_fields(spec, p.gpu_spec), source


def detect_gpu() -> tuple[GpuSpec, str]:
    """This host's GPU 0 and its links (module docstring)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    count = torch.cuda.device_count()
    profile = match_profile(props.name)
    notes = [f"{props.name} x{count}"]
    if profile is not None:
        spec = load_gpu(profile)
        notes.append(f"datasheet figures of conf/gpu/{profile}.yaml")
    else:
        tflops, tbps = _gemm_tflops(), _hbm_tbps()
        spec = GpuSpec(name=props.name, bf16_tflops=tflops, hbm_gb=0, hbm_tbps=tbps, internode_gbps=25.0)
        notes.append(
            f"no profile matches: bf16 {tflops:.0f} TFLOP/s and {tbps:.2f} TB/s measured, network 25 GB/s assumed"
        )
    spec = dataclasses.replace(spec, name=props.name, hbm_gb=round(props.total_memory / 1e9, 1))
    if count > 1:
        p2p = bool(torch.cuda.can_device_access_peer(0, 1))
        gbps = _copy_gbps(0, 1)
        if p2p and gbps > NVLINK_GBPS_ABOVE:
            spec = dataclasses.replace(spec, nvlink_gbps=2 * gbps, pcie_gbps=0.0, p2p=True)
            notes.append(f"NVLink-class copy GPU 0 -> 1: {gbps:.0f} GB/s one way")
        else:
            spec = dataclasses.replace(spec, nvlink_gbps=0.0, pcie_gbps=gbps if p2p else 2 * gbps, p2p=p2p)
            notes.append(
                f"PCIe copy GPU 0 -> 1 {'peer to peer' if p2p else 'through host memory'}: {gbps:.0f} GB/s"
            )
        spec = dataclasses.replace(
            spec, gpus_per_node=count if count < spec.gpus_per_node else spec.gpus_per_node
        )
    return spec, "plan.gpu=auto: " + "; ".join(notes)


def _timed(fn, repeats: int) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream (after one warm-up call)."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _gemm_tflops(n: int = 8192) -> float:
    import torch

    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: a @ b, 10) / 1e12


def _hbm_tbps(numel: int = 256 * 2**20) -> float:
    import torch

    x = torch.empty(numel, device="cuda:0", dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.nbytes / _timed(lambda: y.copy_(x), 10) / 1e12  # a copy reads and writes each byte


def _copy_gbps(src: int, dst: int, numel: int = 128 * 2**20) -> float:
    """One-way GB/s of a copy from GPU ``src`` to GPU ``dst`` (peer to peer where the driver allows,
    else staged through host memory by the driver)."""
    import torch

    x = torch.empty(numel, device=f"cuda:{src}", dtype=torch.float32)
    y = torch.empty(numel, device=f"cuda:{dst}", dtype=torch.float32)
    with torch.cuda.device(src):
        seconds = _timed(lambda: y.copy_(x, non_blocking=True), 5)
    torch.cuda.synchronize(dst)
    return x.nbytes / seconds / 1e9


def resolve_inputs(cfg: Config) -> PlanInputs:
    """:func:`dflash.sizing.inputs.model_inputs` and the GPU of ``plan.gpu`` (``auto`` probes this host's)."""
    gpu, gpu_source = plan_gpu(cfg.plan)
    return dataclasses.replace(model_inputs(cfg), gpu=gpu, gpu_source=gpu_source)
