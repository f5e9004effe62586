"""The exports the serve check hands to vLLM besides the run's own ``drafter/``.

- :func:`relayout_export`: the run's trained weights under another attention layout (every layer sliding,
  or a mixed sliding/full stack), written by the project's exporter. The tensors do not depend on the
  layout, so this is a real export of that layout without a second training run; dflash decodes the
  same drafter with the same layout as the reference.
- :func:`corrupted_copy`: a copy of an export with one ``config.json`` key changed (``dflash_config.mask_token_id=2049``),
  the broken export the check must catch.
- :func:`swapped_taps_copy`: a copy whose ``fc.weight`` column blocks of two taps are swapped (the drafter a
  server builds when it collects the taps in another order than training concatenated them).
- :func:`trained_difference`: how an export differs from the drafter as trained (config read by dflash's
  loader, every tensor), the check made on every export before vLLM serves it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.drafter.arch import DrafterArch
from dflash.drafter.export import export_drafter, load_into
from dflash.drafter.families import build_drafter as build_from_arch
from dflash.drafter.model import DFlashDraftModel


def sliding_layout(num_layers: int) -> list[str]:
    return [SLIDING_ATTENTION] * num_layers


def mixed_layout(num_layers: int) -> list[str]:
    """Sliding and full layers alternating, sliding first (as the Qwen3.6 recipe mixes them)."""
    if num_layers < 2:
        raise ValueError(f"a mixed sliding/full layout needs >= 2 drafter layers, the run has {num_layers}")
    return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]


def relayout(arch: DrafterArch, layer_types: list[str], sliding_window: int | None) -> DrafterArch:
    """``arch`` with another layer layout (window None when no layer is sliding)."""
    window = sliding_window if SLIDING_ATTENTION in layer_types else None
    return dataclasses.replace(arch, layer_types=list(layer_types), sliding_window=window)


def build_drafter(arch: DrafterArch, state: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A drafter of ``arch`` holding ``state`` (the exported tensor names), in eval mode on CPU."""
    model = build_from_arch(arch)
    load_into(model, state)
    return model.eval().requires_grad_(False)


def relayout_export(
    arch: DrafterArch, state: dict[str, torch.Tensor], out_dir: Path, *, target_num_layers: int
) -> Path:
    """Export ``state`` under ``arch`` (already re-laid out) to ``out_dir`` with ``export_drafter``."""
    return export_drafter(build_drafter(arch, state), out_dir, target_num_layers=target_num_layers)


def parse_corruption(spec: str) -> tuple[str, Any]:
    """``"dflash_config.mask_token_id=2049"`` -> ``("dflash_config.mask_token_id", 2049)`` (JSON value)."""
    key, sep, value = spec.partition("=")
    if not sep or not key.strip():
        raise ValueError(
            f"corrupt entry {spec!r}: expected <dotted config.json key>=<JSON value>, e.g. "
            "corrupt=[dflash_config.mask_token_id=2049]"
        )
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt entry {spec!r}: the value is not JSON ({e})") from None


def corrupted_copy(src: Path, dst: Path, key: str, value: Any) -> Any:
    """Copy the export ``src`` to ``dst`` and set the dotted ``key`` of its config.json to ``value``;
    returns the value it replaced. The key must exist (a typo would corrupt nothing)."""
    config = json.loads((src / "config.json").read_text())
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            raise ValueError(f"corrupt key {key!r}: {p!r} is not an object in {src / 'config.json'}")
        node = node[p]
    if leaf not in node:
        raise ValueError(f"corrupt key {key!r}: no {leaf!r} in {src / 'config.json'}")
    old = node[leaf]
    if old == value:
        raise ValueError(f"corrupt key {key!r}: the export already has {value!r}; choose another value")
    node[leaf] = value
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return old


def swapped_taps_copy(src: Path, dst: Path, a: int = 0, b: int = 1) -> str:
    """Copy the export ``src`` to ``dst`` with the ``fc.weight`` column blocks of taps ``a`` and ``b``
    swapped (``fc.weight`` is ``[H, num_taps * H]``, tap i in columns ``i*H:(i+1)*H``), config.json
    unchanged; returns what was swapped."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    fc = state["fc.weight"]
    taps = json.loads((src / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    h = fc.shape[1] // len(taps)
    if len(taps) < 2 or not (0 <= a < len(taps) and 0 <= b < len(taps)) or a == b:
        raise ValueError(f"cannot swap taps {a} and {b} of an export with taps {taps}")
    cols = fc.clone()
    cols[:, a * h : (a + 1) * h], cols[:, b * h : (b + 1) * h] = (
        fc[:, b * h : (b + 1) * h],
        fc[:, a * h : (a + 1) * h],
    )
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    save_file(
        {**state, "fc.weight": cols.contiguous()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    return f"fc.weight column blocks of taps {taps[a]} and {taps[b]} swapped"


def _fc_order(found: torch.Tensor, trained: torch.Tensor, num_taps: int) -> list[int] | None:
    """The tap order whose trained ``fc.weight`` column blocks ``found`` holds (None: not a permutation)."""
    h = trained.shape[1] // num_taps
    blocks = [trained[:, i * h : (i + 1) * h] for i in range(num_taps)]
    order = []
    for i in range(num_taps):
        match = [j for j, blk in enumerate(blocks) if torch.equal(found[:, i * h : (i + 1) * h], blk)]
        if not match:
            return None
        order.append(match[0])
    return order


def trained_difference(
    export_dir: Path, arch: DrafterArch, state: dict[str, torch.Tensor], *, target_num_layers: int
) -> str | None:
    """How the export in ``export_dir`` differs from the drafter as trained (``arch`` and ``state``: the
    run contract's architecture and the checkpoint's weights), None when it is that drafter: its
    config.json refused by dflash's loader (``arch_from_export``: tap ids, block size, layout), read as
    another architecture, or written differently than the exporter writes it; a tensor missing or
    different (``fc.weight`` with its tap column blocks permuted is named as such)."""
    from safetensors.torch import load_file

    from dflash.drafter.export import arch_from_export, export_config

    config = json.loads((export_dir / "config.json").read_text())
    try:
        found = arch_from_export(config)
    except ValueError as e:
        return f"dflash refuses its config.json: {e}"
    if found != arch:
        fields = [k for k, v in found.to_dict().items() if v != arch.to_dict()[k]]
        return "config.json describes another drafter: " + ", ".join(
            f"{k} {arch.to_dict()[k]} -> {found.to_dict()[k]}" for k in fields
        )
    dtype = next(iter(state.values())).dtype
    written = export_config(arch, target_num_layers, dtype)
    keys = sorted(k for k in config.keys() | written.keys() if config.get(k) != written.get(k))
    if keys:
        return f"config.json differs from what the exporter writes in {keys}"
    tensors = load_file(str(export_dir / "model.safetensors"))
    if tensors.keys() != state.keys():
        return f"tensor names differ: {sorted(tensors.keys() ^ state.keys())}"
    bad = [
        k
        for k in sorted(state)
        if tensors[k].shape != state[k].shape or not torch.equal(tensors[k], state[k])
    ]
    if not bad:
        return None
    if bad == ["fc.weight"] and tensors["fc.weight"].shape == state["fc.weight"].shape:
        order = _fc_order(tensors["fc.weight"], state["fc.weight"], arch.num_taps)
        if order is not None:
            taps = [arch.target_layer_ids[i] for i in order]
            return (
                f"fc.weight holds the trained tap column blocks in the order of layers {taps}, while "
                f"target_layer_ids={arch.target_layer_ids}: the served drafter reads its context features permuted"
            )
    return f"tensors differ from the trained ones: {bad}"
