"""Export and import a drafter in the public DFlash checkpoint layout (as the ``*-DFlash-b16`` drafters).

``config.json``: the Qwen3-style config of the drafter layers plus ``architectures:
["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` (layers of the target) and
``dflash_config: {target_layer_ids, mask_token_id, block_size}``. ``model.safetensors``: only the
drafter's own tensors (``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``); no embedding and no lm_head. SGLang
(``--speculative-algorithm DFLASH``) and vLLM load this directory next to the target.

The family (:mod:`dflash.drafter.families`) sets ``architectures`` and adds its own
``dflash_config`` keys: DFlash2 writes ``["DFlash2DraftModel"]`` with ``conv_kernel_size``,
``conv_group_size``, ``selector_rank`` and ``selector_top_k``, and its tensors under the served
names (:mod:`dflash.drafter.dflash2`); import reads the family back from ``architectures``.

Attention layout and causality (the semantics are in ``dflash.drafter.blocks``):
- ``layer_types`` (one entry per layer), ``sliding_window`` (W or null) and ``use_sliding_window``
  (true iff a layer is sliding; transformers' Qwen3Config drops the window otherwise) are always
  written. SGLang and vLLM make a sliding layer causal and a full layer bidirectional from them.
- ``is_causal`` and ``dflash_config.causal`` are written when every layer has the same causality
  (false for all-full, true for all-sliding). vLLM applies either key to *every* layer
  (``_dflash_layer_causal`` in vllm-project/vllm:vllm/model_executor/models/qwen3_dflash.py), so for a
  mixed layout any value would be wrong for some layers: they are left out and ``layer_types`` says it.
- RoPE: ``rope_parameters`` (transformers 5, vLLM), ``rope_theta``/``rope_scaling`` (older readers) and
  ``partial_rotary_factor`` (top level and in ``rope_parameters``) when it is not 1.
- The serving contract's fields (top level, where vLLM reads them off the drafter's config):
  ``is_neox_style: true`` (the drafter's own RoPE layout, :data:`dflash.drafter.model.ROPE_IS_NEOX_STYLE`,
  not the target's) and ``sample_from_anchor: false`` (slot k predicts the token at anchor + k,
  :data:`dflash.drafter.blocks.SAMPLE_FROM_ANCHOR`), for both families.

Import (``arch_from_export``) reads the same keys back and refuses a config whose causality keys
contradict its layer types, a sliding layout without ``use_sliding_window``, or serving-contract
fields this drafter does not train (``is_neox_style: false``, ``sample_from_anchor: true``), naming
the field; an export without them (the published layout) reads as the defaults, which are ours.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.config.checks import tap_ids_problem
from dflash.drafter.arch import DrafterArch, family_fields, mask_token_problem, rope_from_config
from dflash.drafter.blocks import SAMPLE_FROM_ANCHOR
from dflash.drafter.families import FAMILIES, build_drafter, family_of, family_of_architectures
from dflash.drafter.model import ROPE_IS_NEOX_STYLE, DFlashDraftModel
from dflash.files import atomic_directory

ARCHITECTURE = FAMILIES["dflash"].architecture


def drafter_state(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The drafter's own tensors under their public names (RoPE tables are non-persistent buffers)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def export_config(arch: DrafterArch, target_num_layers: int, dtype: torch.dtype) -> dict:
    cfg = arch.qwen3_config().to_dict()
    for key in (
        "transformers_version",
        "_name_or_path",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
    ):
        cfg.pop(key, None)
    dflash_config: dict = {
        "target_layer_ids": list(arch.target_layer_ids),
        "mask_token_id": arch.mask_token_id,
        "block_size": arch.block_size,
    }
    family = family_of(arch)
    dflash_config.update({name: getattr(arch, name) for name in family_fields(arch.family)})
    causal = {t == SLIDING_ATTENTION for t in arch.layer_types}
    if len(causal) == 1:
        cfg["is_causal"] = dflash_config["causal"] = causal.pop()
    rope = dict(arch.rope_parameters)
    if arch.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg["partial_rotary_factor"] = arch.partial_rotary_factor
    cfg.update(
        architectures=[family.architecture],
        model_type="qwen3",
        dtype=str(dtype).removeprefix("torch."),
        use_cache=False,
        block_size=arch.block_size,
        num_target_layers=target_num_layers,
        dflash_config=dflash_config,
        **{key: ours for key, (ours, _) in SERVING_CONTRACT.items()},
        rope_parameters=rope,
        rope_theta=rope["rope_theta"],
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
    )
    return cfg


def export_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, *, target_num_layers: int) -> Path:
    """Write ``config.json`` + ``model.safetensors`` to ``out_dir`` atomically (``atomic_directory``:
    a crash leaves the previous export or the new one, never a mix) and return it."""
    state = drafter_state(model)
    dtype = next(iter(state.values())).dtype
    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(
            json.dumps(export_config(model.arch, target_num_layers, dtype), indent=2)
        )
    return Path(out_dir)


def _layout_of(config: dict, num_layers: int) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of an exported config; ValueError when a server would read a
    different causality or no window."""
    types = list(config.get("layer_types") or [FULL_ATTENTION] * num_layers)
    dcfg = config.get("dflash_config") or {}
    if dcfg.get("use_swa"):
        raise ValueError(
            "dflash_config.use_swa=true (vLLM: every layer sliding, bidirectional unless dflash_config.causal) "
            "is not a layout this pipeline trains; describe the layers with layer_types instead"
        )
    sliding = [i for i, t in enumerate(types) if t == SLIDING_ATTENTION]
    window = config.get("sliding_window") if sliding else None
    if sliding and not (config.get("use_sliding_window") and window):
        raise ValueError(
            f"layer_types has sliding_attention layers {sliding} but use_sliding_window="
            f"{config.get('use_sliding_window')} / sliding_window={window}; transformers (and vLLM, which reads "
            "the config through it) then drop the window: "
            "set use_sliding_window=true and sliding_window=<W>"
        )
    for key, value in (("is_causal", config.get("is_causal")), ("dflash_config.causal", dcfg.get("causal"))):
        if value is None:
            continue
        wrong = [i for i, t in enumerate(types) if bool(value) != (t == SLIDING_ATTENTION)]
        if wrong:
            raise ValueError(
                f"{key}={value} makes layers {wrong} {'causal' if value else 'bidirectional'} in vLLM, but this "
                f"pipeline trains sliding_attention layers causal and full_attention layers bidirectional "
                f"(layer_types={types}); remove {key} or fix layer_types"
            )
        break  # vLLM reads is_causal first; dflash_config.causal only without it
    return types, window


SERVING_CONTRACT = {
    "is_neox_style": (
        ROPE_IS_NEOX_STYLE,
        "its heads' RoPE rotated in interleaved pairs; this drafter rotates halves (GPT-NeoX)",
    ),
    "sample_from_anchor": (
        SAMPLE_FROM_ANCHOR,
        "slot k predicting the token at anchor + k + 1; this drafter's slot k predicts anchor + k",
    ),
}
"""The serving-contract fields of an export: the one value each may have here, and what another
value would say the drafter was trained with."""

HEAD_TRANSFORMS = {"final_logit_softcapping": None, "output_multiplier": 1.0}
"""``dflash_config`` keys of published DFlash2 layouts (z-lab's fixture) that change the logits of the
target head the drafter shares, and the value that leaves them unchanged: this pipeline's loss and
decoder apply the target's head as it is."""


def _head_transform_problem(config: dict) -> str | None:
    """Why the export's head transforms (:data:`HEAD_TRANSFORMS`) are not the plain head; None when
    absent or plain."""
    dcfg = config.get("dflash_config") or {}
    for key, plain in HEAD_TRANSFORMS.items():
        value = dcfg.get(key, plain)
        if value is not None and value != plain:
            return (
                f"dflash_config.{key}={json.dumps(value)}: the export's drafts go through the target head "
                f"with this transform, which this pipeline's loss, eval and decoder do not apply (they use the "
                "target's head as it is), so it would evaluate and fine-tune a different model"
            )
    return None


def _serving_contract_problem(config: dict) -> str | None:
    """Why the export's ``is_neox_style`` / ``sample_from_anchor`` (top level or in ``dflash_config``)
    are not what this drafter trains; None when absent (the engines' defaults are ours) or equal."""
    dcfg = config.get("dflash_config") or {}
    for key, (ours, what) in SERVING_CONTRACT.items():
        for where, value in ((key, config.get(key)), (f"dflash_config.{key}", dcfg.get(key))):
            if value is not None and value is not ours:
                return (
                    f"{where}={json.dumps(value)}: the export says it was trained with {what}, so its weights "
                    f"would serve and evaluate wrongly here; only {key}={json.dumps(ours)} (or no {key}) loads"
                )
    return None


def _block_size_of(config: dict) -> int:
    """The export's block size: top-level ``block_size`` and ``dflash_config.block_size`` (servers read
    one or the other) must agree when both are written."""
    top, inner = config.get("block_size"), (config.get("dflash_config") or {}).get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ValueError(
            f"block_size={top} (top level) and dflash_config.block_size={inner} differ: servers read one or the "
            "other; set both to the block size the drafter was trained with (its run's drafter.block_size)"
        )
    size = top if top is not None else inner
    if size is None:
        raise KeyError("block_size")
    if not isinstance(size, int) or size < 2:
        raise ValueError(f"block_size={size}: must be an integer >= 2 (the drafter's drafter.block_size)")
    return size


def _tap_ids_of(config: dict) -> list[int]:
    """``dflash_config.target_layer_ids``: distinct layers of the ``num_target_layers``-layer target (when
    the export says how many) in increasing order, the order servers collect the taps in."""
    ids = (config.get("dflash_config") or {})["target_layer_ids"]
    where = f"dflash_config.target_layer_ids={ids}"
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: must be a list of decoder layer indices")
    num_layers = config.get("num_target_layers")
    if isinstance(num_layers, int):
        problem = tap_ids_problem(ids, num_layers)
    elif any(i < 0 for i in ids):
        problem = f"layers {[i for i in ids if i < 0]} are negative"
    else:  # the target's layer count is checked where the target is known
        problem = tap_ids_problem(ids, max(ids, default=0) + 1)
    if problem:
        raise ValueError(
            f"{where}: {problem}; restore the ids the drafter was trained on (its run's target.layer_ids, which "
            "dflash exports in increasing order), or retrain it with increasing target.layer_ids"
        )
    return ids


def arch_from_export(config: dict) -> DrafterArch:
    """The DrafterArch described by an exported ``config.json`` (ValueError naming a missing or bad field)."""
    family = family_of_architectures(list(config.get("architectures") or []))
    dcfg = config.get("dflash_config") or {}
    try:
        missing = [name for name in family_fields(family.name) if name not in dcfg]
        if missing:
            raise KeyError(f"dflash_config.{missing[0]}")
        own = {name: dcfg[name] for name in family_fields(family.name)}
        num_layers = config["num_hidden_layers"]
        block_size = _block_size_of(config)
        layer_ids = _tap_ids_of(config)
        rope, partial = rope_from_config(config)
        layer_types, window = _layout_of(config, num_layers)
        if (problem := _head_transform_problem(config) or _serving_contract_problem(config)) is not None:
            raise ValueError(problem)
        return DrafterArch(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            target_layer_ids=layer_ids,
            block_size=int(block_size),
            mask_token_id=dcfg["mask_token_id"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            rope_parameters=rope,
            partial_rotary_factor=partial,
            initializer_range=config.get("initializer_range", 0.02),
            layer_types=layer_types,
            sliding_window=window,
            family=family.name,
            **own,
        )
    except KeyError as e:
        raise ValueError(f"exported drafter config.json lacks field {e.args[0]!r}") from None


def exported_arch(path: str | os.PathLike) -> DrafterArch:
    """The architecture of an exported drafter directory, from its config.json (no tensor read)."""
    d = Path(path)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise ValueError(
            f"drafter.init_from={str(d)!r} is not an exported drafter (needs config.json and model.safetensors)"
        )
    try:
        return arch_from_export(json.loads((d / "config.json").read_text()))
    except ValueError as e:
        raise ValueError(f"drafter.init_from={str(d)!r}: {e}") from None


def recorded_mask_token_id(export_dir: str | os.PathLike) -> int | None:
    """The mask token id the export's own tokenizer records (``mask_token`` in its
    ``tokenizer_config.json``); None when the export ships no tokenizer (dflash's do not) or its
    tokenizer names no mask token."""
    d = Path(export_dir)
    if not (d / "tokenizer_config.json").is_file():
        return None
    if not json.loads((d / "tokenizer_config.json").read_text()).get("mask_token"):
        return None
    from transformers import AutoTokenizer

    tid = AutoTokenizer.from_pretrained(str(d)).mask_token_id
    return int(tid) if tid is not None else None


def export_mask_problem(
    export_dir: str | os.PathLike, tid: int, tokenizer: Any, vocab_size: int
) -> str | None:
    """Why ``tid`` (an export's ``dflash_config.mask_token_id``) is not a MASK the drafter can have been
    trained with (None when it can): not the id the export's own tokenizer records, when it ships one;
    else ``mask_token_problem`` against the target's tokenizer."""
    recorded = recorded_mask_token_id(export_dir)
    if recorded is not None and tid != recorded:
        return f"not {recorded}, the mask token the export's own tokenizer records"
    if recorded is not None and 0 <= tid < vocab_size:
        return None
    return mask_token_problem(tid, tokenizer, vocab_size)


def load_exported(path: str | os.PathLike) -> tuple[DrafterArch, dict[str, torch.Tensor]]:
    """Read an exported drafter directory: (architecture, tensors by public name)."""
    arch = exported_arch(path)
    return arch, load_file(str(Path(path) / "model.safetensors"))


def tensor_problems(path: str | os.PathLike, arch: DrafterArch) -> list[str]:
    """How the tensors of an export differ from the drafter ``arch`` describes: missing, unexpected
    and mis-shaped names, from the safetensors header alone (no tensor data read)."""
    from safetensors import safe_open

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_drafter(arch).state_dict().items()}
    file = Path(path) / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    where = f"drafter.init_from={path}: model.safetensors"
    p = [f"{where} lacks {k} {expected[k]}" for k in sorted(set(expected) - set(found))]
    p += [f"{where} holds {k}, which this drafter does not have" for k in sorted(set(found) - set(expected))]
    p += [
        f"{where} has {k} of shape {found[k]}, this drafter needs {expected[k]}"
        for k in sorted(set(found) & set(expected))
        if found[k] != expected[k]
    ]
    return p[:8] + ([f"... and {len(p) - 8} more"] if len(p) > 8 else [])


def warm_start_problems(
    saved: DrafterArch, current: DrafterArch, target_num_layers: int | None = None
) -> list[str]:
    """Why a saved drafter cannot initialise the current one (empty when it can); each fix names a
    value that passes the checks (the saved tap ids only when they are layers of a
    ``target_num_layers``-layer target)."""
    taps_fit = target_num_layers is None or tap_ids_problem(saved.target_layer_ids, target_num_layers) is None
    p = []
    if saved.family != current.family:
        return [
            f"drafter.init_from: the saved drafter is drafter.family={saved.family}, this run trains "
            f"{current.family}; set drafter.family={saved.family}"
        ]
    for field, fix in (
        *((f, f"set drafter.{f} to the saved value") for f in family_fields(current.family)),
        ("hidden_size", "train a drafter for this target instead"),
        (
            "target_layer_ids",
            f"set target.layer_ids={saved.target_layer_ids}"
            if taps_fit
            else f"its taps are not layers of this {target_num_layers}-layer target: warm-start from a drafter "
            "trained on this target",
        ),
        ("mask_token_id", f"set drafter.mask_token_id={saved.mask_token_id} (or null: the saved one)"),
        ("num_layers", "set drafter.num_layers to the saved value"),
        ("intermediate_size", "set drafter.intermediate_size to the saved value"),
        ("num_heads", "set drafter.num_heads to the saved value"),
        ("num_kv_heads", "set drafter.num_kv_heads to the saved value"),
        ("head_dim", "set drafter.head_dim to the saved value"),
        ("layer_types", "set drafter.layer_types=null to keep the saved layout"),
        ("sliding_window", "set drafter.sliding_window=null to keep the saved window"),
        ("partial_rotary_factor", "set drafter.partial_rotary_factor=null to keep the saved one"),
    ):
        a, b = getattr(saved, field), getattr(current, field)
        if a != b:
            p.append(f"drafter.init_from: {field} of the saved drafter is {a}, this run needs {b}; {fix}")
    return p


def load_into(model: DFlashDraftModel, state: dict[str, torch.Tensor]) -> None:
    """Copy exported tensors into ``model`` (exact names and shapes required)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter tensors do not match: missing={missing[:5]} unexpected={unexpected[:5]}")
