"""The drafter a run trains, resolved against its target before any weight loads.

``resolve_drafter`` gives the tap ids and the drafter architecture (the MASK token, the layer layout
of a ``drafter.init_from`` export) and raises one ``UserError`` listing every problem the target's
config and tokenizer show. The training job and ``python -m dflash.data.prepare`` both call it, so
prepare reports exactly what training would refuse.
"""

from __future__ import annotations

from dflash.config import Config
from dflash.config.checks import raise_problems
from dflash.config.resolve import resolve_path
from dflash.drafter.arch import DrafterArch, arch_problems, build_arch, resolve_mask_token_id
from dflash.drafter.export import exported_arch, tensor_problems, warm_start_problems
from dflash.targets.info import TargetInfo, target_problems
from dflash.targets.loader import resolve_layer_ids


def resolve_drafter(cfg: Config, target: TargetInfo) -> tuple[list[int], DrafterArch]:
    """The tap ids and the drafter architecture (MASK token, warm-start layout); raises one
    ``UserError`` listing every problem the target's config and tokenizer show."""
    problems = target_problems(target, cfg.data, cfg.drafter.block_size) + arch_problems(
        cfg.drafter, target.meta
    )
    try:
        layer_ids = resolve_layer_ids(cfg.target, target.meta)
    except ValueError as e:
        problems.append(str(e))
        layer_ids = list(cfg.target.layer_ids or [])
    init_from = resolve_path(cfg.drafter.init_from) if cfg.drafter.init_from else None
    saved_arch = exported_arch(init_from) if init_from else None
    try:
        mask_id = resolve_mask_token_id(
            cfg.drafter.mask_token_id,
            saved_arch.mask_token_id if saved_arch else None,
            target.tokenizer,
            target.meta.vocab_size,
        )
    except ValueError as e:
        problems.append(str(e))
        mask_id = 0
    try:
        arch = build_arch(cfg, target.meta, layer_ids, mask_id, saved_arch)
    except ValueError as e:  # a layout that config_problems cannot see (e.g. taken from init_from)
        raise_problems([*problems, f"drafter: {e}"], "config")
        raise
    if init_from and saved_arch is not None:
        problems += warm_start_problems(saved_arch, arch) or tensor_problems(init_from, arch)
    raise_problems(problems, "config")
    return layer_ids, arch
