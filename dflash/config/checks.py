"""Cross-field validation of a composed config: every problem in one message, before anything runs.

``validate(cfg, world_size)`` checks what needs several fields at once (the schema in
:mod:`dflash.config` already typed each field alone) and raises one ``UserError`` listing every
problem, each naming the field, the bad value and the override that fixes it. It runs on every
rank before any model loads or process group starts. ``check_known_keys`` refuses keys the schema
does not know (``+key=...`` would otherwise be ignored silently).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash.config import (
    DEFAULT_NUM_TAPS,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Config,
    DrafterConfig,
    UserError,
)
from dflash.config.modes import topology_problems
from dflash.config.resolve import device_kind, drafter_attention


class _Problems(list[str]):
    """Problem messages; ``need(cond, msg)`` adds ``msg`` unless ``cond`` holds."""

    def need(self, cond: bool, msg: str) -> None:
        if not cond:
            self.append(msg)


def _topology_problems(cfg: Config, world_size: int, p: _Problems) -> None:
    """The rank layout (the topology mode's rules, ``dflash.config.modes``) and what the whole target
    on one rank excludes."""
    p.extend(topology_problems(cfg.topology, world_size))
    k = cfg.topology.target_tp
    p.need(
        k <= 1 or cfg.eval.every <= 0,
        f"eval.every={cfg.eval.every} with topology.target_tp={k}: the periodic eval runs the whole target "
        "on the drafter leader; set eval.every=0 and evaluate the export where the target fits",
    )


TAP_ORDER = (
    "not in increasing order: the taps are concatenated in list order, while vLLM and SGLang collect "
    "them in layer order, so a served drafter would read its context features permuted"
)
"""Why tap ids must increase (the refusal of an unsorted ``target.layer_ids`` or export)."""


def tap_ids_problem(ids: list[int], num_layers: int) -> str | None:
    """Why ``ids`` cannot be the tap ids of a ``num_layers``-layer target (None when they can): none,
    a layer outside ``[0, num_layers)``, a layer listed twice, or not in increasing order."""
    if not ids:
        return "no layer"
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        return f"layers {bad} outside the target's {num_layers} decoder layers [0, {num_layers - 1}]"
    if len(set(ids)) != len(ids):
        return f"layers {sorted({i for i in ids if ids.count(i) > 1})} listed more than once"
    return TAP_ORDER if list(ids) != sorted(ids) else None


def _target_problems(cfg: Config, p: _Problems) -> None:
    """Tap ids and the remote-code pin."""
    tg = cfg.target
    if tg.layer_ids is not None:
        ids = [int(i) for i in tg.layer_ids]
        fix = f"target.layer_ids={sorted({i for i in ids if i >= 0})}"  # valid once each is in the target
        p.need(
            len(ids) > 0,
            "target.layer_ids=[] is empty; list at least one tapped layer or set target.layer_ids=null",
        )
        p.need(
            min(ids, default=0) >= 0,
            f"target.layer_ids={ids} has a negative id; tap ids are decoder layer indices >= 0",
        )
        p.need(
            len(set(ids)) == len(ids),
            f"target.layer_ids={ids} has duplicates; list each tapped layer once ({fix})",
        )
        p.need(
            len(set(ids)) != len(ids) or min(ids, default=0) < 0 or ids == sorted(ids),
            f"target.layer_ids={ids} is {TAP_ORDER}; set {fix}",
        )
        if tg.num_taps is not None:
            p.need(
                tg.num_taps == len(tg.layer_ids),
                f"target.num_taps={tg.num_taps} but target.layer_ids lists "
                f"{len(tg.layer_ids)} layers; set target.num_taps=null (it only matters without layer_ids)",
            )
    elif tg.num_taps is not None:
        p.need(
            tg.num_taps >= 1, f"target.num_taps={tg.num_taps}: must be >= 1 (or null for {DEFAULT_NUM_TAPS})"
        )
    if tg.trust_remote_code:
        rev = tg.revision or ""
        p.need(
            len(rev) == 40 and all(c in "0123456789abcdef" for c in rev.lower()),
            f"target.trust_remote_code=true needs target.revision=<40-hex commit hash> (got {tg.revision!r}) so the code that runs is pinned",
        )


def _drafter_problems(cfg: Config, p: _Problems) -> None:
    """Drafter shape, anchors (a static cap with flex) and the layer layout."""
    d = cfg.drafter
    p.need(d.num_layers >= 1, f"drafter.num_layers={d.num_layers}: must be >= 1")
    p.need(d.block_size >= 2, f"drafter.block_size={d.block_size}: must be >= 2 (slot 0 is the given token)")
    p.need(
        d.block_size < cfg.data.max_length,
        f"drafter.block_size={d.block_size} is not below data.max_length={cfg.data.max_length}: a block predicts "
        f"block_size - 1 tokens of one sample; use a block size like the public 16",
    )
    p.need(d.num_anchors >= 1, f"drafter.num_anchors={d.num_anchors}: must be >= 1")
    p.need(
        math.isfinite(d.hidden_noise_std) and d.hidden_noise_std >= 0,
        f"drafter.hidden_noise_std={d.hidden_noise_std}: must be a finite number >= 0 (0: no noise; e.g. 0.05)",
    )
    if d.max_anchors_per_packet is not None:
        p.need(
            d.max_anchors_per_packet >= 1,
            f"drafter.max_anchors_per_packet={d.max_anchors_per_packet}: must be >= 1 or null",
        )
    elif drafter_attention(d.attention, device_kind(cfg.topology.device)) == "flex":
        p.append(
            f"drafter.max_anchors_per_packet=null with flex attention (drafter.attention={d.attention} on "
            f"topology.device={cfg.topology.device}, here {device_kind(cfg.topology.device)}): packets are padded to a static number "
            "of blocks so flex_attention compiles once; set drafter.max_anchors_per_packet (e.g. 2048)"
        )
    if d.block_chunks is not None:
        p.need(
            d.block_chunks >= 1,
            f"drafter.block_chunks={d.block_chunks}: must be >= 1 (1: all blocks at once) or null (auto)",
        )
    if d.mask_token_id is not None:
        p.need(d.mask_token_id >= 0, f"drafter.mask_token_id={d.mask_token_id}: must be >= 0 or null")
    p.extend(layout_problems(d))


def _data_problems(cfg: Config, p: _Problems) -> None:
    """Lengths, budgets, epochs and counts of ``data``."""
    dt = cfg.data
    p.need(dt.max_length >= 2, f"data.max_length={dt.max_length}: must be >= 2")
    p.need(
        dt.token_budget >= dt.max_length,
        f"data.token_budget={dt.token_budget} < data.max_length={dt.max_length}: a packet must hold the longest sample; "
        f"set data.token_budget={dt.max_length} or more",
    )
    p.need(dt.num_epochs >= 1, f"data.num_epochs={dt.num_epochs}: must be >= 1")
    p.need(
        0.0 <= dt.max_skip_fraction <= 1.0,
        f"data.max_skip_fraction={dt.max_skip_fraction}: must be in [0, 1]",
    )
    if dt.num_samples is not None:
        p.need(dt.num_samples >= 1, f"data.num_samples={dt.num_samples}: must be >= 1 or null")
    if dt.num_eval_prompts is not None:
        p.need(dt.num_eval_prompts >= 0, f"data.num_eval_prompts={dt.num_eval_prompts}: must be >= 0 or null")
    if dt.max_record_chars is not None:
        p.need(
            dt.max_record_chars >= 1,
            f"data.max_record_chars={dt.max_record_chars}: must be >= 1 or null (32 x data.max_length)",
        )
    p.need(dt.num_workers >= 1, f"data.num_workers={dt.num_workers}: must be >= 1")


def _loss_problems(cfg: Config, p: _Problems) -> None:
    """Loss coefficients, temperature, decay and the chunk settings."""
    lo = cfg.loss
    terms = {
        f.name: float(getattr(lo, f.name)) for f in dataclasses.fields(lo) if f.metadata.get("loss_term")
    }
    negative = [f"loss.{n}={c}" for n, c in terms.items() if not c >= 0]
    p.need(not negative, f"{', '.join(negative)}: a loss coefficient must be >= 0")
    p.need(
        sum(terms.values()) > 0,
        f"{', '.join('loss.' + n for n in terms)} are all 0: nothing to train; set loss.ce=1.0",
    )
    p.need(lo.temperature > 0, f"loss.temperature={lo.temperature}: must be > 0")
    p.need(lo.gamma > 0, f"loss.gamma={lo.gamma}: must be > 0")
    p.need(0.0 <= lo.dpace <= 1.0, f"loss.dpace={lo.dpace}: must be in (0, 1] (D-PACE's a), or 0 for off")
    p.need(
        lo.dpace_normalizer in ("sum", "count"),
        f"loss.dpace_normalizer={lo.dpace_normalizer}: must be sum or count",
    )
    if lo.dpace > 0:
        p.need(
            terms.get("kl", 0.0) == 0,
            f"loss.dpace={lo.dpace} with loss.kl={terms.get('kl')}: D-PACE weighs slots by exp(-cross-entropy); "
            "set loss.kl=0 (loss=dpace) or loss.dpace=0",
        )
    if lo.chunk_size is not None:
        p.need(
            lo.chunk_size >= 1,
            f"loss.chunk_size={lo.chunk_size}: must be >= 1 or null (from loss.mem_budget_gib)",
        )
    p.need(lo.mem_budget_gib > 0, f"loss.mem_budget_gib={lo.mem_budget_gib}: must be > 0")


def _optim_and_train_problems(cfg: Config, p: _Problems) -> None:
    """Optimizer and training-loop settings."""
    o = cfg.optim
    p.need(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    p.need(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    p.need(0.0 <= o.warmup_ratio < 1.0, f"optim.warmup_ratio={o.warmup_ratio}: must be in [0, 1)")
    p.need(o.max_grad_norm > 0, f"optim.max_grad_norm={o.max_grad_norm}: must be > 0")
    p.need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    for beta in ("beta1", "beta2"):
        value = getattr(o, beta)
        p.need(0.0 <= value < 1.0, f"optim.{beta}={value}: must be in [0, 1)")
    p.need(o.eps > 0, f"optim.eps={o.eps}: must be > 0")
    if o.muon_lr is not None:
        p.need(o.muon_lr > 0, f"optim.muon_lr={o.muon_lr}: must be > 0, or null (= optim.lr)")
    p.need(0.0 <= o.muon_momentum < 1.0, f"optim.muon_momentum={o.muon_momentum}: must be in [0, 1)")
    p.need(
        1 <= o.muon_ns_steps <= 99, f"optim.muon_ns_steps={o.muon_ns_steps}: must be in [1, 99] (5 is usual)"
    )
    p.need(o.muon_weight_decay >= 0, f"optim.muon_weight_decay={o.muon_weight_decay}: must be >= 0")
    p.need(o.grad_accum_steps >= 1, f"optim.grad_accum_steps={o.grad_accum_steps}: must be >= 1")
    tr = cfg.train
    if tr.max_steps is not None:
        p.need(tr.max_steps >= 1, f"train.max_steps={tr.max_steps}: must be >= 1 or null (whole data plan)")
    p.need(tr.save_every >= 1, f"train.save_every={tr.save_every}: must be >= 1")
    p.need(
        tr.keep_checkpoints >= 2,
        f"train.keep_checkpoints={tr.keep_checkpoints}: keep at least 2 so a damaged newest one has a fallback",
    )
    p.need(tr.log_every >= 1, f"train.log_every={tr.log_every}: must be >= 1")
    if tr.stop_after_steps is not None:
        p.need(
            tr.stop_after_steps >= 1,
            f"train.stop_after_steps={tr.stop_after_steps}: must be >= 1 (a step to stop after) or null",
        )


def _eval_problems(cfg: Config, p: _Problems) -> None:
    """The periodic eval and the held-out conversations it needs."""
    ev = cfg.eval
    p.need(ev.every >= 0, f"eval.every={ev.every}: must be >= 0 (0 = off)")
    p.need(
        ev.max_share is None or ev.max_share > 0,
        f"eval.max_share={ev.max_share}: must be > 0 (a share of the training time) or null (no limit)",
    )
    if ev.every > 0:
        p.need(
            ev.num_prompts >= 1,
            f"eval.num_prompts={ev.num_prompts}: must be >= 1, or set eval.every=0 (no eval)",
        )
        p.need(
            ev.max_new_tokens >= 1,
            f"eval.max_new_tokens={ev.max_new_tokens}: must be >= 1, or set eval.every=0 (no eval)",
        )
        p.need(
            ev.max_samples is None or ev.max_samples >= 1,
            f"eval.max_samples={ev.max_samples}: must be >= 1 or null (every row of each benchmark)",
        )
        held_out = cfg.data.num_eval_prompts
        if held_out is not None and ev.num_prompts >= 1:
            p.need(
                held_out >= 1,
                f"eval.every={ev.every} but data.num_eval_prompts=0 holds out no conversation to evaluate on; "
                f"set data.num_eval_prompts={ev.num_prompts} (or null: as many as eval.num_prompts), or eval.every=0",
            )


def config_problems(cfg: Config, world_size: int) -> list[str]:
    """Every problem that the config alone shows (no model, no file read); empty when valid."""
    p = _Problems()
    _topology_problems(cfg, world_size, p)
    _target_problems(cfg, p)
    _drafter_problems(cfg, p)
    _data_problems(cfg, p)
    _loss_problems(cfg, p)
    _optim_and_train_problems(cfg, p)
    _eval_problems(cfg, p)
    p.need(
        cfg.logging.init_timeout_s > 0,
        f"logging.init_timeout_s={cfg.logging.init_timeout_s}: must be > 0 (seconds wandb.init may take)",
    )
    return list(p)


def layout_problems(d: DrafterConfig) -> list[str]:
    """Problems of ``drafter.layer_types`` / ``sliding_window`` / ``partial_rotary_factor`` alone."""
    p: list[str] = []
    types = [str(t) for t in d.layer_types] if d.layer_types is not None else None
    if types is None and d.init_from is None:
        types = [FULL_ATTENTION] * d.num_layers
    if types is not None:
        if len(types) != d.num_layers:
            p.append(
                f"drafter.layer_types lists {len(types)} layers but drafter.num_layers={d.num_layers}; "
                f"give one entry per layer (or drafter.layer_types=null for all {FULL_ATTENTION})"
            )
    if d.sliding_window is not None:
        if d.sliding_window < max(d.block_size, 2):
            p.append(
                f"drafter.sliding_window={d.sliding_window}: must be >= drafter.block_size={d.block_size} "
                "(a window inside the block is windowed differently by SpecForge and the servers)"
            )
        if types is not None and SLIDING_ATTENTION not in types:
            p.append(
                f"drafter.sliding_window={d.sliding_window} but no drafter.layer_types entry is "
                f"{SLIDING_ATTENTION!r} (null = all {FULL_ATTENTION}); set drafter.sliding_window=null or "
                "make a layer sliding"
            )
    elif types is not None and SLIDING_ATTENTION in types:
        p.append(
            f"drafter.layer_types has {SLIDING_ATTENTION!r} layers but drafter.sliding_window=null; "
            "set drafter.sliding_window=<W, e.g. 2048>"
        )
    f = d.partial_rotary_factor
    if f is not None and not 0.0 < f <= 1.0:
        p.append(f"drafter.partial_rotary_factor={f}: must be in (0, 1] or null (the target's)")
    return p


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one ``UserError`` listing every problem (one alone: its own line), or nothing when
    there is none."""
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        lines = "\n".join(f"  - {m}" for m in problems)
        raise UserError(f"{len(problems)} {what} problem(s):\n{lines}")


def validate(cfg: Config, world_size: int) -> None:
    """Raise one ValueError listing every config problem (run on every rank before any model loads)."""
    raise_problems(config_problems(cfg, world_size), "config")


def unknown_keys(node: dict, schema: type, prefix: str = "") -> list[str]:
    """Keys of a composed config that the schema does not know (``+key=...`` bypasses Hydra's own
    check), each as ``"<key>"`` plus the closest known key when there is one. Free-form fields
    (``dict[str, Any]``) may hold any key."""
    import difflib

    out: list[str] = []
    hints = typing.get_type_hints(schema)
    known = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        name = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), known, n=1)
            out.append(f"{name} (did you mean {prefix}{close[0]}?)" if close else name)
            continue
        hint = hints[key]
        subs = [
            t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)
        ]
        value = node[key]
        if subs and isinstance(value, dict):
            out += unknown_keys(value, subs[0], f"{name}.")
    return out


def known_keys_only(node: dict, schema: type) -> dict:
    """``node`` without the keys the schema does not know (a config written by an earlier version
    of dflash, read back: a field it had and this version dropped or renamed)."""
    hints = typing.get_type_hints(schema)
    out = {}
    for key, value in node.items():
        if key not in hints:
            continue
        hint = hints[key]
        subs = [
            t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)
        ]
        out[key] = known_keys_only(value, subs[0]) if subs and isinstance(value, dict) else value
    return out


def check_known_keys(dcfg: DictConfig, schema: type) -> None:
    """Raise ``UserError`` naming every key the schema does not know (with the closest known key)."""
    node = OmegaConf.to_container(dcfg, resolve=False)
    assert isinstance(node, dict)
    unknown = unknown_keys(node, schema)
    if unknown:
        raise UserError(
            "unknown config key(s): " + "; ".join(unknown) + ". A key that is not in the schema would be "
            "ignored, so the run is refused; fix the name (python -m dflash.train --cfg job prints every key)"
        )


def _plain_dotted_key(arg: str) -> str | None:
    """The key of a plain ``a.b=value`` override (None: a group choice, a ``+``/``++``/``~`` or
    ``hydra.`` override, ``key@package``, a flag)."""
    key = arg.split("=", 1)[0]
    if "=" not in arg or "." not in key or key.startswith(("-", "+", "~", "hydra.", "hydra/")) or "@" in key:
        return None
    return key


def _walk_key(key: str, schema: type) -> tuple[str, int]:
    """Where the dotted ``key`` leads in the schema: ``("field", n)`` a field (or a nested value of
    a typed list), ``("free", n)`` inside a free-form ``dict`` field after ``n`` parts,
    ``("unknown", n)`` no field at part ``n``."""
    cls: Any = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return "unknown", depth
        hint = hints[part]
        subs = [t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)]
        if subs:
            cls = subs[0]
            continue
        is_dict = typing.get_origin(hint) is dict or dict in typing.get_args(hint)
        return ("free" if is_dict and depth < len(parts) - 1 else "field"), depth + 1
    return "field", len(parts)


RENAMED = {"topology.colocated": "topology.mode=colocated (or the group topology=colocated)"}
"""Keys of earlier versions -> what replaced them (named when a command line still uses one)."""


def override_key_problems(args: list[str], schema: type) -> list[str]:
    """Command-line overrides ``a.b=value`` whose dotted key the schema does not have, each with the
    closest known key. Hydra's own message for one advises ``+a.b=value``, which adds a key the
    schema then refuses (``check_known_keys``); this names the key that exists instead. Group
    choices (``target=qwen3_8b``), ``+``/``~``/``hydra.`` overrides and flags are left to Hydra."""
    import difflib

    out = []
    for arg in args:
        key = _plain_dotted_key(arg)
        if key is None:
            continue
        where, depth = _walk_key(key, schema)
        if where != "unknown":
            continue
        if key in RENAMED:
            out.append(f"{key} (renamed: use {RENAMED[key]})")
            continue
        parts = key.split(".")
        cls: Any = schema
        for part in parts[:depth]:
            hint = typing.get_type_hints(cls)[part]
            cls = next(t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t))
        close = difflib.get_close_matches(parts[depth], [f.name for f in dataclasses.fields(cls)], n=1)
        prefix = ".".join(parts[:depth])
        out.append(f"{key} (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else key)
    return out


def free_form_overrides(args: list[str], schema: type) -> list[str]:
    """The command line with every plain override of a key inside a free-form ``dict`` field
    (``data.chat_template_kwargs.enable_thinking=false``) written ``++key=value`` (add or
    override): Hydra's struct mode refuses a new key there without a ``+``, and refuses ``+`` for a
    key an experiment already sets."""
    return [
        f"++{arg}"
        if (key := _plain_dotted_key(arg)) is not None and _walk_key(key, schema)[0] == "free"
        else arg
        for arg in args
    ]
