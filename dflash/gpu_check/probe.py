"""The target probe of part colocated: the random target's headless forward on one packet (as the target ranks
run it) against ``model(...)``: peak memory above the weights, the largest tensor, the logits it makes.
On a GPU it runs in a subprocess of its own (``scripts/gpu_check.py --probe-target <json>``)."""

from __future__ import annotations

import time
from typing import Any

from dflash.gpu_check.planner import training_config


def _rss(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _watch(vocab_size: int) -> Any:
    """A dispatch mode that records the largest tensor made and every ``[..., vocab_size]`` tensor."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

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
                    if t.dim() >= 2 and t.shape[-1] == vocab_size:
                        self.vocab.append(list(t.shape))
            return out

    return Watch()


def _sync(device: Any) -> None:
    """Wait for the current stream (this process runs no collective)."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _measured(fn: Any, device: Any, vocab_size: int) -> dict[str, Any]:
    """Run ``fn`` under inference mode and the watch: seconds, peak memory above the start, the
    largest tensor and the vocabulary-sized ones."""
    import torch

    from dflash.metrics import reset_peak_memory

    cuda = device.type == "cuda"
    _sync(device)
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device) if cuda else _rss("VmRSS")
    watch = _watch(vocab_size)
    t = time.perf_counter()
    with watch, torch.inference_mode():
        result = fn()
    _sync(device)
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


def _random_packet(spec: dict[str, Any], pack: bool, device: Any) -> tuple[Any, Any, Any, list[int]]:
    """``spec["tokens"]`` random token ids (below ``spec["vocab_used"]``) in ``spec["docs"]`` documents,
    batched as the target ranks batch them: ``(input_ids, attention_mask or None, position_ids,
    the documents' lengths)``."""
    import torch

    from dflash.targets.forward import build_batch

    tokens, docs = spec["tokens"], spec["docs"]
    g = torch.Generator().manual_seed(0)
    lens = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    seqs = [torch.randint(0, spec["vocab_used"], (n,), generator=g) for n in lens]
    ids, attn, pos, _ = build_batch(seqs, pack=pack, pad_id=0)
    return ids.to(device), (attn.to(device) if attn is not None else None), pos.to(device), lens


def probe_target(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the random target as the trainer does, forward one packet headless (as the target ranks
    do) and through ``model(...)``: peak memory above the weights, largest tensor made, and every
    tensor whose last dimension is the vocabulary (the logits). ``spec``: the run's ``overrides``, the
    packet's ``tokens`` and ``docs``, and ``vocab_used`` (token ids are drawn below it)."""
    import torch

    from dflash.config.resolve import torch_dtype
    from dflash.targets.forward import target_forward
    from dflash.targets.loader import load_target, read_target_meta, resolve_layer_ids

    cfg = training_config(spec["overrides"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(cfg.target.dtype, device)
    meta = read_target_meta(cfg.target.path)
    layer_ids = resolve_layer_ids(cfg.target, meta)
    t0 = time.perf_counter()
    model = load_target(cfg.target, device, dtype)
    build_s = time.perf_counter() - t0
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    ids, attn, pos, lens = _random_packet(spec, cfg.target.pack, device)

    def headless():  # the target ranks' forward: masks from the documents' lengths
        return target_forward(model, ids, attn, layer_ids, position_ids=pos, seq_lens=lens)

    def full():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits

    with torch.inference_mode():
        headless()  # warm-up: kernels, allocator, workspaces
    _sync(device)
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "attention": str(model.config._attn_implementation),
        "tokens": spec["tokens"],
        "docs": spec["docs"],
        "build_s": round(build_s, 2),
        "weights_gib": round(weights / 2**30, 3),
        "num_taps": len(layer_ids),
        "logits_gib": round(spec["tokens"] * meta.vocab_size * torch.finfo(dtype).bits / 8 / 2**30, 3),
        "headless": _measured(headless, device, meta.vocab_size),
        "full": _measured(full, device, meta.vocab_size),
    }
