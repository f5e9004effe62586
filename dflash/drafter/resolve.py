"""The drafter a run trains, resolved against its target before any weight loads.

``resolve_drafter`` gives the tap ids and the drafter architecture (the MASK token, the layer layout
of a ``drafter.init_from`` export) and raises one ``UserError`` listing every problem the target's
config and tokenizer show. The training job and ``python -m dflash.data.prepare`` both call it, so
prepare reports exactly what training would refuse.
"""

from __future__ import annotations

import dataclasses

from dflash.config import Config
from dflash.config.checks import raise_problems
from dflash.config.resolve import resolve_path
from dflash.drafter.arch import (
    DrafterArch,
    arch_problems,
    build_arch,
    default_mask_token_id,
    resolve_mask_token_id,
)
from dflash.drafter.export import export_mask_problem, exported_arch, tensor_problems, warm_start_problems
from dflash.targets.info import TargetInfo, target_problems
from dflash.targets.loader import resolve_layer_ids


def resolve_drafter(cfg: Config, target: TargetInfo) -> tuple[list[int], DrafterArch]:
    """The tap ids and the drafter architecture (MASK token, warm-start layout); raises one
    ``UserError`` listing every problem the target's config and tokenizer show."""
    problems = target_problems(target, cfg.data, cfg.drafter.block_size) + arch_problems(
        cfg.drafter, target.meta
    )
    init_from = resolve_path(cfg.drafter.init_from) if cfg.drafter.init_from else None
    saved_arch = exported_arch(init_from) if init_from else None
    try:
        layer_ids = resolve_layer_ids(cfg.target, target.meta)
    except ValueError as e:
        problems.append(str(e))
        layer_ids = list(saved_arch.target_layer_ids) if saved_arch else [0]  # stands in: refused anyway
    vocab = target.meta.vocab_size
    saved_mask = saved_arch.mask_token_id if saved_arch else None
    saved_problem = (
        export_mask_problem(init_from, saved_mask, target.tokenizer, vocab)
        if init_from and saved_mask is not None
        else None
    )
    try:
        mask_id = resolve_mask_token_id(
            cfg.drafter.mask_token_id, None if saved_problem else saved_mask, target.tokenizer, vocab
        )
    except ValueError as e:
        problems.append(str(e))
        mask_id = None
    if saved_problem and cfg.drafter.mask_token_id is None:  # the saved MASK would be used: refused
        default = default_mask_token_id(target.tokenizer, vocab)
        fix = (
            f"drafter.mask_token_id={default}"
            if default is not None
            else "drafter.mask_token_id=<an unused row>"
        )
        problems.append(
            f"drafter.init_from={init_from}: dflash_config.mask_token_id={saved_mask} is {saved_problem}, a MASK "
            f"that degrades acceptance silently; set {fix} to warm-start with a new MASK (learned anew), "
            "or warm-start from an export with a valid one"
        )
        mask_id = None
    try:
        arch = build_arch(cfg, target.meta, layer_ids, mask_id if mask_id is not None else 0, saved_arch)
    except ValueError as e:  # a layout that config_problems cannot see (e.g. taken from init_from)
        raise_problems([*problems, f"drafter: {e}"], "config")
        raise
    if init_from and saved_arch is not None:
        compared = saved_arch
        if mask_id is None or saved_problem:
            # the saved MASK is refused above, or replaced by drafter.mask_token_id: one message, not two
            compared = dataclasses.replace(saved_arch, mask_token_id=arch.mask_token_id)
        problems += warm_start_problems(compared, arch, target.meta.num_layers) or tensor_problems(
            init_from, arch
        )
    raise_problems(problems, "config")
    return layer_ids, arch
