#!/usr/bin/env python
"""Parity of our DFlash2 export and decode with the z-lab reference ``DFlash2DraftModel``.

The reference (z-lab/dflash:dflash/model.py, the version with ``DFlash2DraftModel``: its
``GroupedDynamicCausalConv``, ``CandidateSelector`` and ``dflash_generate``) is not part of this
repository: point the script at a checkout or at that file. For the shipped tiny target it

1. exports a DFlash2 drafter of ours (``--drafter DIR``: an export, e.g. one a run wrote; default: a
   random one with every convolution and the selector moved off their identity init, so that each
   of them decides drafts), in the served layout;
2. loads the export with the reference's own ``DFlash2DraftModel.from_pretrained`` (its key mapping
   of the codebooks) and fails on any missing, unexpected or mis-shaped key;
3. runs the reference's greedy ``dflash_generate`` and ``dflash.eval``'s ``speculative_generate`` on
   the same prompts in float64 and compares the drafted tokens of every step, the outputs and the
   acceptance lengths (tau).

The reference shortens its last blocks to the tokens left (``verify_size``), where dflash.eval
drafts full blocks and cuts the output; steps whose block the reference shortened are left out of
the draft and acceptance comparison (never the outputs), and the count of compared steps is printed.
The reference times with ``torch.cuda.synchronize``; on a CPU the script swaps in a plain clock.

    python scripts/zlab_dflash2_parity.py /path/to/z-lab-dflash [--drafter outputs/<run>/drafter]

It prints one JSON line per prompt and exits non-zero on a mismatch. ``DFLASH_ZLAB_DFLASH2_REF=<path>
pytest tests/unit/test_zlab_parity.py`` runs it in the test suite (skipped without the variable).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from dflash.config import TinyTargetConfig
from dflash.drafter.arch import DrafterArch, rope_from_config
from dflash.drafter.export import export_drafter, load_exported, load_into
from dflash.drafter.families import build_drafter
from dflash.eval.spec_decode import StepTrace, speculative_generate
from dflash.targets.loader import load_embed_and_head
from dflash.targets.tiny import ensure_tiny_target

PROMPTS = ["def foo(x):\n    return", "import os\nimport", "class A:", "for i in range(10):\n"]
TAPS, BLOCK, NEW_TOKENS = [1, 2, 4], 4, 40


def load_reference(path: str) -> ModuleType:
    """z-lab's ``dflash/model.py`` (with DFlash2) as a module, from a checkout root or the file."""
    sys.path.insert(0, str(Path(__file__).parent))
    from zlab_parity import load_reference as load

    module = load(path)
    if not hasattr(module, "DFlash2DraftModel"):
        raise SystemExit(f"{path}: this z-lab dflash/model.py predates DFlash2DraftModel")
    module._cuda_time = time.perf_counter  # its timing calls torch.cuda.synchronize
    return module


def random_drafter(target_config, mask_id: int):
    """A DFlash2 drafter for the tiny target with every DFlash2 parameter off its identity init."""
    rope, partial = rope_from_config(target_config.to_dict())
    arch = DrafterArch(
        hidden_size=target_config.hidden_size,
        intermediate_size=128,
        num_layers=2,
        num_heads=target_config.num_attention_heads,
        num_kv_heads=target_config.num_key_value_heads,
        head_dim=target_config.head_dim,
        vocab_size=target_config.vocab_size,
        target_layer_ids=TAPS,
        block_size=BLOCK,
        mask_token_id=mask_id,
        rope_parameters=rope,
        partial_rotary_factor=partial,
        family="dflash2",
        conv_group_size=16,
        selector_rank=16,
        selector_top_k=6,
    )
    model = build_drafter(arch)
    model.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.family_modules():
            for p in module.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def reference_drafts(zlab: ModuleType, ref, target, ids: torch.Tensor, new_tokens: int):
    """The reference's generation with the draft tokens of each of its steps recorded."""
    drafts: list[list[int]] = []
    propose = ref.propose

    def recording(*args, **kwargs):
        tokens, candidates, probs = propose(*args, **kwargs)
        drafts.append(tokens[0].tolist())
        return tokens, candidates, probs

    ref.propose = recording
    try:
        stats = zlab.dflash_generate(ref, target, ids, new_tokens, None, return_stats=True)
    finally:
        ref.propose = propose
    return stats, drafts


def compare(zlab: ModuleType, drafter_dir: Path, target_dir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref, info = zlab.DFlash2DraftModel.from_pretrained(
        str(drafter_dir), output_loading_info=True, dtype=torch.float64
    )
    problems = {k: list(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise SystemExit(
            f"the reference did not load {drafter_dir} exactly: {problems or info['error_msgs']}"
        )
    ref = ref.eval()
    arch, state = load_exported(drafter_dir)
    ours = build_drafter(arch)
    load_into(ours, state)
    ours = ours.double().eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    embed, head = load_embed_and_head(str(target_dir))
    results = []
    for text in PROMPTS:
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        stats, ref_drafts = reference_drafts(zlab, ref, target, torch.tensor([prompt]), NEW_TOKENS)
        traces: list[StepTrace] = []
        mine = speculative_generate(
            target,
            ours,
            embed,
            head,
            prompt,
            max_new_tokens=NEW_TOKENS,
            eos_token_ids=set(),
            layer_ids=list(arch.target_layer_ids),
            block_size=arch.block_size,
            on_step=traces.append,
        )
        ref_out = stats.output_ids[0, len(prompt) :].tolist()
        full = [i for i, t in enumerate(traces) if t.anchor + arch.block_size <= len(prompt) + NEW_TOKENS]
        same_drafts = all(traces[i].block[1:] == ref_drafts[i] for i in full)
        same_accept = all(mine.accept_lengths[i] == stats.acceptance_lengths[i] for i in full)
        ok = ref_out == mine.output_ids and same_drafts and same_accept and len(full) >= 3
        results.append(
            {
                "prompt": text,
                "steps_compared": len(full),
                "tau_dflash_eval": mine.tau,
                "tau_reference": sum(stats.acceptance_lengths) / len(stats.acceptance_lengths),
                "tau_compared_steps": sum(mine.accept_lengths[i] for i in full) / max(len(full), 1),
                "same_outputs": ref_out == mine.output_ids,
                "same_drafts": same_drafts,
                "same_accept_lengths": same_accept,
                "ok": ok,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("zlab", help="z-lab/dflash checkout with DFlash2 (or its dflash/model.py)")
    parser.add_argument("--drafter", help="an exported DFlash2 drafter for the tiny target (default: random)")
    args = parser.parse_args(argv)
    zlab = load_reference(args.zlab)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = ensure_tiny_target(Path(tmp) / "target", TinyTargetConfig())
        if args.drafter:
            drafter_dir = Path(args.drafter)
        else:
            from transformers import AutoConfig, AutoTokenizer

            config = AutoConfig.from_pretrained(target_dir)
            model = random_drafter(config, len(AutoTokenizer.from_pretrained(target_dir)))
            drafter_dir = export_drafter(
                model, Path(tmp) / "drafter", target_num_layers=config.num_hidden_layers
            )
        results = compare(zlab, drafter_dir, target_dir)
    for r in results:
        print(json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
