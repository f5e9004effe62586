#!/usr/bin/env python
"""Parity of our drafter with the z-lab reference ``DFlashDraftModel`` (z-lab/dflash:dflash/model.py).

For three tiny layouts (all full, all sliding, mixed sliding + full; window 6 < the 20- and 14-token
documents, so the window cuts context) this exports a random drafter of ours, loads the export into
the reference strictly (its ``config.json`` through transformers' ``Qwen3Config``, every tensor name
and shape through ``load_state_dict(strict=True)``), checks that the reference reads the sliding
layout from the config, and runs both in float64 on the same packed batch with the same explicit
masks (ours, ``blocks.build_masks``). The reference's own ``forward`` takes one mask for every
layer, so a mixed layout runs its modules layer by layer with each layer's mask (its forward body:
``hidden_norm(fc(.))``, ``rotary_emb``, the layers, ``norm``). Our training forward must equal it, and
must differ from a run without the window (the window matters in this batch).

The reference is not part of this repository: point the script at a checkout of z-lab/dflash
(``git clone https://github.com/z-lab/dflash``) or at its ``dflash/model.py``::

    python scripts/zlab_parity.py /path/to/z-lab-dflash

It prints one JSON line per layout and exits non-zero on a mismatch. ``DFLASH_ZLAB_REF=<path> pytest
tests/unit/test_zlab_parity.py`` runs it in the test suite (skipped without the variable).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

from dflash.drafter.arch import DrafterArch
from dflash.drafter.blocks import build_masks, make_blocks, sample_anchors
from dflash.drafter.export import export_drafter
from dflash.drafter.model import DFlashDraftModel
from dflash.targets.packing import doc_ids_from_positions

BS, WINDOW, MASK_ID, TAPS = 4, 6, 119, [1, 3, 5]
LAYOUTS = {
    "full": ["full_attention"] * 3,
    "sliding": ["sliding_attention"] * 3,
    "mixed": ["sliding_attention", "full_attention", "sliding_attention"],
}
TOLERANCE = 1e-9


def load_reference(path: str) -> ModuleType:
    """z-lab's ``dflash/model.py`` as a module, from a checkout root or the file itself."""
    file = Path(path)
    if file.is_dir():
        file = file / "dflash" / "model.py"
    if not file.is_file():
        raise SystemExit(f"no z-lab dflash/model.py at {path}")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drafter(layer_types: list[str], seed: int) -> DFlashDraftModel:
    sliding = "sliding_attention" in layer_types
    arch = DrafterArch(
        hidden_size=64,
        intermediate_size=96,
        num_layers=len(layer_types),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=120,
        target_layer_ids=TAPS,
        block_size=BS,
        mask_token_id=MASK_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=layer_types,
        sliding_window=WINDOW if sliding else None,
    )
    model = DFlashDraftModel(arch).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random norms too, so that a swapped or skipped norm shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def batch(seed: int):
    """Two packed documents (20 and 14 tokens), 8 sampled anchors: ids, positions, docs, anchors, taps."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(20), torch.arange(14)]).unsqueeze(0)
    doc = doc_ids_from_positions(pos)
    anchors = sample_anchors(torch.ones_like(pos), doc, 4, g)
    ids = torch.randint(0, MASK_ID, pos.shape, generator=g)
    aux = torch.randn(1, pos.shape[1], len(TAPS) * 64, generator=g, dtype=torch.float64)
    emb = torch.randn(120, 64, generator=g, dtype=torch.float64)
    return ids, pos, doc, anchors, aux, emb


def reference_forward(ref, layer_types, masks, position_ids, noise, target_hidden) -> torch.Tensor:
    """The reference with one explicit mask per layer kind: its own forward when one mask serves
    every layer, else its forward body over its own modules."""
    kinds = set(layer_types)
    if len(kinds) == 1:
        mask = masks[kinds.pop()].dense
        return ref(
            position_ids=position_ids, attention_mask=mask, noise_embedding=noise, target_hidden=target_hidden
        )
    context = ref.hidden_norm(ref.fc(target_hidden))
    rope = ref.rotary_emb(noise, position_ids)
    h = noise
    for layer, kind in zip(ref.layers, layer_types, strict=True):
        h = layer(
            hidden_states=h,
            target_hidden=context,
            attention_mask=masks[kind].dense,
            position_ids=position_ids,
            position_embeddings=rope,
        )
    return ref.norm(h)


def check(zlab: ModuleType, name: str, layer_types: list[str], out_dir: Path) -> dict:
    from transformers import Qwen3Config

    ours = drafter(layer_types, seed=len(name))
    export = export_drafter(ours, out_dir / name, target_num_layers=8)
    config = Qwen3Config.from_pretrained(export)
    config._attn_implementation = "sdpa"  # takes the explicit mask (flash would apply its own window)
    ref = zlab.DFlashDraftModel(config).to(torch.float64).eval()
    ref.load_state_dict(load_file(str(export / "model.safetensors")), strict=True)
    windows = [layer.self_attn.sliding_window for layer in ref.layers]
    expected_windows = [WINDOW if t == "sliding_attention" else None for t in layer_types]

    ids, pos, doc, anchors, aux, emb = batch(seed=7)
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    masks = build_masks(anchors, doc, BS, "sdpa", layer_types, ours.arch.sliding_window)
    no_window = build_masks(anchors, doc, BS, "sdpa", ["full_attention"], None)["full_attention"]
    with torch.no_grad():
        mine = ours(noise, aux, pos, blocks.block_positions, masks)
        theirs = reference_forward(
            ref, layer_types, masks, torch.cat([pos, blocks.block_positions], dim=1), noise, aux
        )
        unwindowed = ours(noise, aux, pos, blocks.block_positions, dict.fromkeys(masks, no_window))
    diff = float((mine - theirs).abs().max())
    window_effect = float((mine - unwindowed).abs().max())
    ok = diff < TOLERANCE and windows == expected_windows
    if "sliding_attention" in layer_types:
        ok = ok and window_effect > 1e-3
    return {
        "layout": name,
        "layer_types": layer_types,
        "reference_windows": windows,
        "max_abs_diff": diff,
        "window_effect": window_effect,
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("zlab", help="z-lab/dflash checkout (or its dflash/model.py)")
    args = parser.parse_args(argv)
    zlab = load_reference(args.zlab)
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layer_types in LAYOUTS.items():
            results.append(check(zlab, name, layer_types, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
