"""The exports the serve check hands to vLLM besides the run's own ``drafter/``.

- :func:`relayout_export`: the run's trained weights under another attention layout (every layer sliding,
  or a mixed sliding/full stack), written by the project's exporter. The tensors do not depend on the
  layout, so this is a real export of that layout without a second training run; dflash decodes the
  same drafter with the same layout as the reference.
- :func:`corrupted_copy`: a copy of an export with one ``config.json`` key changed (``dflash_config.mask_token_id=2049``),
  the broken export the check must catch.
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
