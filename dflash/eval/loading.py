"""Loading for the eval: target, exported drafter, embed/head, tokenizer, prompts and eos ids.

:func:`load_for_eval` checks the :class:`~dflash.eval.config.EvalAppConfig` (:func:`eval_config_problems`)
and the exported drafter against the target (:func:`drafter_problems`) before the target's weights
load, reporting every problem at once, and returns an :class:`EvalSetup`. :func:`load_prompts`,
:func:`prompt_from_record` and :func:`eos_ids_of` are also used by the periodic eval during training.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.config.resolve import resolve_device, resolve_path, torch_dtype
from dflash.drafter.arch import DrafterArch
from dflash.drafter.model import DFlashDraftModel
from dflash.eval.suites import suite_problems

if TYPE_CHECKING:
    from dflash.eval.config import EvalAppConfig

log = logging.getLogger(__name__)


@dataclass
class EvalSetup:
    target: torch.nn.Module
    drafter: DFlashDraftModel
    embed: torch.Tensor
    head: torch.Tensor
    tokenizer: Any
    prompts: list[list[int]]
    layer_ids: list[int]
    block_size: int
    eos_ids: set[int]
    device: torch.device
    target_path: str
    drafter_path: str
    max_positions: int | None = None
    """The target's max_position_embeddings (None when its config has none)."""


def eval_config_problems(cfg: EvalAppConfig) -> list[str]:
    """Problems the eval config alone shows (no file read); empty when valid."""
    p = []
    if cfg.max_new_tokens < 1:
        p.append(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if cfg.block_size is not None and cfg.block_size < 1:
        p.append(f"block_size={cfg.block_size}: must be >= 1 (1 = plain decoding) or null for the drafter's")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        p.append(f"num_prompts={cfg.num_prompts}: must be >= 1 or null (all prompts)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        p.append("device=cuda but CUDA is not available; set device=cpu (or auto)")
    if cfg.prompts is not None and not cfg.prompts.strip():
        p.append(
            "prompts='': name a prompts file (prompts=<prompts.jsonl> or a datasets path), or use suite=zlab"
        )
    elif (cfg.prompts is None) == (cfg.suite is None):
        p.append(
            f"prompts={cfg.prompts!r} and suite={cfg.suite!r}: set exactly one (prompts=<prompts.jsonl> "
            "for a prompt file, suite=zlab or suite=[gsm8k,mt-bench] for benchmarks)"
        )
    if cfg.max_samples is not None and cfg.max_samples < 1:
        p.append(f"max_samples={cfg.max_samples}: must be >= 1 or null (every row of each benchmark)")
    if cfg.gather_timeout_s <= 0:
        p.append(f"gather_timeout_s={cfg.gather_timeout_s}: must be > 0")
    return p + suite_problems(cfg.suite, cfg.data_dir)


def raise_problems(problems: list[str]) -> None:
    """One ValueError listing every problem (none: nothing)."""
    if problems:
        lines = "\n".join(f"  - {m}" for m in problems)
        raise ValueError(f"{len(problems)} eval config problem(s):\n{lines}")


def drafter_problems(arch: DrafterArch, exported_cfg: dict, meta: Any, cfg: EvalAppConfig) -> list[str]:
    """Why an exported drafter cannot run against this target (empty when it can)."""
    p = []
    where = f"drafter_path={cfg.drafter_path}"
    tgt = f"target {cfg.target.name} ({cfg.target.path})"
    fix = "evaluate the drafter against the target it was trained for (target=... / target.path=...)"
    if arch.hidden_size != meta.hidden_size:
        p.append(
            f"{where}: the drafter's hidden_size={arch.hidden_size} differs from {tgt} hidden_size="
            f"{meta.hidden_size} (it reuses the target's embedding and lm_head); {fix}"
        )
    if arch.vocab_size != meta.vocab_size:
        p.append(
            f"{where}: the drafter's vocab_size={arch.vocab_size} differs from {tgt} vocab_size="
            f"{meta.vocab_size}; {fix}"
        )
    n_layers = exported_cfg.get("num_target_layers")
    if n_layers is not None and int(n_layers) != meta.num_layers:
        p.append(
            f"{where}: the drafter was exported for a {n_layers}-layer target, {tgt} has "
            f"{meta.num_layers} layers; {fix}"
        )
    bad = [i for i in arch.target_layer_ids if not 0 <= i < meta.num_layers]
    if bad:
        p.append(
            f"{where}: the drafter's tap ids (dflash_config.target_layer_ids={arch.target_layer_ids}) "
            f"include {bad}, outside the {meta.num_layers} decoder layers of {tgt}; {fix}"
        )
    if (
        cfg.target.layer_ids is not None
        and [int(i) for i in cfg.target.layer_ids] != list(arch.target_layer_ids)
        and not bad  # then the export itself is wrong for this target (above): no override fixes it
    ):
        p.append(
            f"target.layer_ids={list(cfg.target.layer_ids)} but the drafter was trained on taps "
            f"{arch.target_layer_ids}; set target.layer_ids={list(arch.target_layer_ids)} "
            f"(or target.layer_ids=null to use the drafter's)"
        )
    return p


def mask_problems(
    cfg: EvalAppConfig, drafter_dir: Path, arch: DrafterArch, tokenizer: Any, vocab_size: int
) -> list[str]:
    """Why the export's ``dflash_config.mask_token_id`` cannot be the MASK the drafter was trained with
    (``dflash.drafter.export.export_mask_problem``); a warning when it is an unused row other than the
    one dflash picks by default (possible, but an edited id looks the same)."""
    from dflash.drafter.arch import default_mask_token_id
    from dflash.drafter.export import export_mask_problem, recorded_mask_token_id

    tid = arch.mask_token_id
    default = default_mask_token_id(tokenizer, vocab_size)
    problem = export_mask_problem(drafter_dir, tid, tokenizer, vocab_size)
    if problem:
        return [
            f"drafter_path={cfg.drafter_path}: dflash_config.mask_token_id={tid} is {problem}, a MASK that "
            "degrades acceptance silently; set dflash_config.mask_token_id in its config.json to the MASK the "
            "drafter was trained with (its run's drafter.mask_token_id"
            + (f", or {default} where that is null)" if default is not None else ")")
        ]
    if tid != default and tid >= len(tokenizer) and recorded_mask_token_id(drafter_dir) is None:
        log.warning(
            "drafter_path=%s: dflash_config.mask_token_id=%d is an unused embedding row but not %s, the one "
            "dflash picks by default; if the drafter was trained with another MASK, tau drops silently",
            cfg.drafter_path,
            tid,
            default,
        )
    return []


def prompt_from_record(record: Any, tokenizer: Any, template_kwargs: dict[str, Any]) -> list[int]:
    """Prompt ids of one record: the chat-template prompt of its messages (up to the last assistant
    message), or for a pretokenized record (input_ids + loss_mask, no messages) the ids before the
    first supervised token. Raises ValueError (MalformedConversation) on unusable records."""
    from dflash.data.chat import prompt_ids
    from dflash.data.sources import parse_conversation
    from dflash.data.tokenize import pretokenized

    if isinstance(record, dict) and "input_ids" in record and "messages" not in record:
        token_ids, mask = pretokenized(record)
        first = int(mask.argmax()) if mask.any() else len(token_ids)
        if first == 0:
            raise ValueError("pretokenized record supervises its first token: no prompt")
        return [int(i) for i in token_ids[:first]]
    conversation = parse_conversation(record)
    ids = prompt_ids(tokenizer, conversation.messages, tools=conversation.tools, **template_kwargs)
    if not ids:
        raise ValueError("empty prompt")
    return ids


def load_prompts(
    path: str | list[str],
    tokenizer: Any,
    *,
    split: str = "train",
    num_prompts: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    field_name: str = "prompts",
    vocab_size: int | None = None,
) -> list[list[int]]:
    """Prompt ids from a JSONL of {"messages": [...]} or any source ``dflash.data.sources.Source``
    opens (first ``num_prompts`` usable records; unusable ones, and with ``vocab_size`` those with
    an id outside ``[0, vocab_size)``, are skipped with a warning). ValueError naming
    ``target.tokenizer`` when a record needs a chat template the tokenizer lacks."""
    import jinja2

    from dflash.data.sources import Source
    from dflash.data.tokenize import MissingChatTemplate, require_chat_template

    out: list[list[int]] = []
    skipped = 0
    for idx, where, rec in Source(path, split, field=field_name).numbered():
        try:
            if not (isinstance(rec, dict) and "input_ids" in rec and "messages" not in rec):
                require_chat_template(tokenizer, where, field_name)
            ids = prompt_from_record(rec, tokenizer, template_kwargs or {})
            if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
                bad = next(i for i in ids if not 0 <= i < vocab_size)
                raise ValueError(f"token id {bad} outside the target vocabulary [0, {vocab_size})")
        except MissingChatTemplate:
            raise
        except (ValueError, jinja2.TemplateError) as exc:
            skipped += 1
            log.warning("%s record %d (%s) skipped: %s", field_name, idx, where, exc)
            continue
        out.append(ids)
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(
            f"{field_name}={path!r}: no usable prompt ({skipped} records skipped, see the warnings); each record "
            'needs {"messages": [{"role": ..., "content": ...}, ...]} (or input_ids within the target '
            "vocabulary: check target.tokenizer)"
        )
    if skipped:
        log.warning("%s: %d records skipped, %d prompts used", field_name, skipped, len(out))
    return out


def eos_ids_of(tokenizer: Any, target: torch.nn.Module | None) -> set[int]:
    """The tokenizer's eos plus the target's generation_config eos (an int or a list)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return ids


def _drafter_dir(cfg: EvalAppConfig) -> Path:
    """The exported drafter directory of ``drafter_path`` (ValueError when it is not one)."""
    drafter_dir = Path(resolve_path(cfg.drafter_path))
    if not drafter_dir.is_dir():
        raise ValueError(
            f"drafter_path={cfg.drafter_path!r} is not a directory ({drafter_dir}); set "
            "drafter_path=<a drafter exported with dflash.drafter.export (config.json + model.safetensors)>"
        )
    missing = [f for f in ("config.json", "model.safetensors") if not (drafter_dir / f).is_file()]
    if missing:
        raise ValueError(
            f"drafter_path={cfg.drafter_path!r} lacks {missing}: not an exported drafter; set "
            "drafter_path=<a drafter exported with dflash.drafter.export (config.json + model.safetensors)>"
        )
    return drafter_dir


def _exported(cfg: EvalAppConfig, drafter_dir: Path) -> tuple[dict, DrafterArch]:
    """The exported drafter's config.json and its architecture (ValueError naming ``drafter_path``)."""
    from dflash.drafter.export import arch_from_export

    exported_cfg = json.loads((drafter_dir / "config.json").read_text())
    try:
        return exported_cfg, arch_from_export(exported_cfg)
    except ValueError as exc:
        raise ValueError(f"drafter_path={cfg.drafter_path!r}: {exc}") from None


def _frozen_drafter(
    arch: DrafterArch, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> DFlashDraftModel:
    """The exported weights in a drafter on ``device``, in eval mode, frozen, parameters in ``dtype``."""
    from dflash.drafter.export import load_into
    from dflash.drafter.families import build_drafter

    drafter = build_drafter(arch)
    load_into(drafter, state)
    drafter.to(device).eval().requires_grad_(False)
    with torch.no_grad():  # parameters only: the RoPE inv_freq buffer stays fp32, as in the target
        for param in drafter.parameters():
            param.data = param.data.to(dtype)
    return drafter


def _prompt_file(
    cfg: EvalAppConfig, path: str, tokenizer: Any, meta: Any, block_size: int
) -> list[list[int]]:
    """The prompts of ``prompts`` (ValueError when one cannot be decoded within the target's context)."""
    prompts = load_prompts(
        path,
        tokenizer,
        split=cfg.split,
        num_prompts=cfg.num_prompts,
        template_kwargs=dict(cfg.data.chat_template_kwargs),
        vocab_size=meta.vocab_size,
    )
    too_long = [
        i
        for i, ids in enumerate(prompts)
        if meta.max_position_embeddings
        and len(ids) + cfg.max_new_tokens + block_size > meta.max_position_embeddings
    ]
    if too_long:
        raise ValueError(
            f"prompts {too_long[:5]}: prompt + max_new_tokens={cfg.max_new_tokens} + block size exceeds the "
            f"target's max_position_embeddings={meta.max_position_embeddings}; lower max_new_tokens"
        )
    return prompts


def load_for_eval(cfg: EvalAppConfig) -> EvalSetup:
    """Target (full ``*ForCausalLM``, it verifies), exported drafter, embed/head (the target's own
    weights; ``load_embed_and_head`` when the model does not expose them), tokenizer, and the prompts
    of ``prompts`` (none with a suite: its turns are rendered while decoding). The device is
    ``device``'s, on a torchrun launch the GPU of ``LOCAL_RANK``.

    Every mismatch between the drafter and the target, weights that cannot fit the device (the
    planner's count from both config.json files) and prompts the target cannot read are reported
    before anything large is read or allocated, each naming the field and the fix.
    """
    from transformers import AutoTokenizer

    from dflash.data.sources import Source
    from dflash.drafter.export import load_exported
    from dflash.sizing.memory import drafter_weights_problem
    from dflash.targets.loader import (
        device_capacity,
        load_embed_and_head,
        load_target,
        read_target_meta,
        target_embed_and_head,
        target_size_problems,
    )
    from dflash.targets.tiny import tiny_target_path

    raise_problems(eval_config_problems(cfg))
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")), field="device")
    dtype = torch_dtype(cfg.target.dtype, device)
    target_path = tiny_target_path(
        cfg.target, resolve_path(cfg.target.path), resolve_path(cfg.paths.cache_dir)
    )
    drafter_dir = _drafter_dir(cfg)
    prompts_path = resolve_path(cfg.prompts) if cfg.prompts is not None else None
    if prompts_path is not None:  # a missing prompts file is named before any load
        Source(prompts_path, cfg.split, field="prompts")
    exported_cfg, arch = _exported(cfg, drafter_dir)
    meta = read_target_meta(
        target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    drafter_size = drafter_weights_problem(  # built in fp32, then cast
        f"drafter_path={drafter_dir}/config.json", arch, 4, *device_capacity(device)
    )
    tok_path = resolve_path(cfg.target.tokenizer) if cfg.target.tokenizer else target_path
    tokenizer = AutoTokenizer.from_pretrained(
        tok_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    raise_problems(
        drafter_problems(arch, exported_cfg, meta, cfg)
        + mask_problems(cfg, drafter_dir, arch, tokenizer, meta.vocab_size)
        + target_size_problems(meta, f"target.path={target_path} (config.json)", dtype, device)
        + ([drafter_size] if drafter_size else [])
    )
    _, state = load_exported(drafter_dir)
    block_size = cfg.block_size or arch.block_size
    prompts = _prompt_file(cfg, prompts_path, tokenizer, meta, block_size) if prompts_path is not None else []

    tcfg = type(cfg.target)(**{**asdict(cfg.target), "path": target_path})
    target = load_target(tcfg, device, dtype, decoding=True)
    drafter = _frozen_drafter(arch, state, device, dtype)
    embed, head = target_embed_and_head(target)
    if embed is None or head is None:
        embed, head = load_embed_and_head(
            target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
        )
    eos = set(cfg.eos_token_ids) if cfg.eos_token_ids is not None else eos_ids_of(tokenizer, target)
    return EvalSetup(
        target=target,
        drafter=drafter,
        embed=embed.to(device, dtype),
        head=head.to(device, dtype),
        tokenizer=tokenizer,
        prompts=prompts,
        layer_ids=list(arch.target_layer_ids),
        block_size=block_size,
        eos_ids=eos,
        device=device,
        target_path=target_path,
        drafter_path=str(drafter_dir),
        max_positions=meta.max_position_embeddings or None,
    )
