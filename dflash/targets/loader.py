"""Load the frozen target, read its shape from config.json, and read embedding/lm_head by name.

Three ways in, from cheapest to most expensive:
- ``read_target_meta``: the target's shape from ``config.json`` only (no weights). For VLM wrappers
  such as ``qwen3_5`` (a ``text_config`` inside) it describes the text model, exactly as
  ``AutoModelForCausalLM`` does when it swaps in ``config.get_text_config()``.
- ``load_embed_and_head``: the ``[V, H]`` embedding and lm_head read by tensor name from the
  checkpoint's safetensors file(s), without building the model (the drafter needs only these two).
- ``load_target``: the whole frozen ``*ForCausalLM`` (eval, no grad) for the target ranks. Target
  ranks run only ``base_model(model)`` (headless): see ``dflash.targets.forward``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash.config import DEFAULT_NUM_TAPS, TargetConfig
from dflash.config.checks import tap_ids_problem
from dflash.config.resolve import target_attention
from dflash.metrics import human_count
from dflash.targets.families import TargetMeta, meta_from_config, target_weights_problem
from dflash.targets.linear_attention import install_varlen
from dflash.targets.tp import distributed_config, local_num_bytes, replica_mesh

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

RANDOM_WEIGHTS_SEED = 1234
"""Seed of ``target.random_weights``: every rank builds the same random target."""

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

EMBED_NAMES = (
    "model.embed_tokens.weight",  # Qwen3, Llama, Qwen3_5ForCausalLM
    "model.language_model.embed_tokens.weight",  # Qwen3.5/3.6 VLM checkpoints (transformers 5 layout)
    "language_model.model.embed_tokens.weight",  # older VLM layout
    "embed_tokens.weight",  # a bare base-model checkpoint
)
HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.language_model.lm_head.weight",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_local_dir(path: str) -> bool:
    """Whether ``path`` names a directory on this machine (transformers then loads it, not the hub)."""
    return os.path.isdir(os.path.expanduser(path))


def check_remote_code_source(cfg: TargetConfig, path: str) -> None:
    """Refuse ``trust_remote_code`` with a pinned ``revision`` for a local directory ``path``: the pin
    fixes what is downloaded from the hub, so locally it checks nothing and the directory's own
    Python files would run as if they were the pinned code."""
    _check_local_remote_code(path, cfg.revision, cfg.trust_remote_code)


def _check_local_remote_code(path: str, revision: str | None, trust_remote_code: bool) -> None:
    if trust_remote_code and revision is not None and is_local_dir(path):
        raise ValueError(
            f"target.trust_remote_code=true with target.revision={revision} but target.path={path} is a local "
            "directory: a revision pins only what is downloaded from the hub, so here it checks nothing and "
            "the directory's own Python files would run; give the hub id (target.path=<org>/<name>) with the "
            "revision, or set target.trust_remote_code=false (transformers' own code)"
        )


def _load_config(path: str, revision: str | None, trust_remote_code: bool):
    """The target's config; a path that is neither a checkpoint directory nor a reachable hub id is a
    ``ValueError`` saying which, and what to give instead. A text config.json without
    ``num_key_value_heads`` gets ``num_attention_heads`` (no grouped-query attention), as its
    checkpoint has; some config classes (Qwen3) would otherwise fill in their own default."""
    from transformers import AutoConfig

    _check_local_remote_code(path, revision, trust_remote_code)
    local = path.startswith(("/", "./", "../", "~")) or os.path.isabs(path) or os.path.exists(path)
    if local and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(
            f"target.path={path}: no such directory; give a local directory with config.json (+ the tokenizer "
            f"for prepare and plan, + *.safetensors to train), or a hub id with network access"
        )
    if local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise ValueError(
            f"target.path={path}: the directory has no config.json; give the target's checkpoint directory"
        )
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        raw, _ = type(config).get_config_dict(path, revision=revision)
    except (
        OSError,
        ValueError,
    ) as e:  # HFValidationError is a ValueError; offline or missing repos are OSErrors
        if local:
            raise ValueError(f"target.path={path}: config.json cannot be read ({e})") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        raise ValueError(
            f"target.path={path} is not a local directory and the hub "
            f"{'is off (HF_HUB_OFFLINE=1)' if offline else 'has no such model or cannot be reached'}: give a local "
            f"directory with config.json (+ the tokenizer for prepare and plan, + *.safetensors to train), or a hub "
            f"id with network access (e.g. download it first: huggingface-cli download {path} --local-dir <dir>; "
            f"prepare and plan need only config.json and the tokenizer files)"
        ) from None
    text, raw_text = config.get_text_config(decoder=True), raw.get("text_config") or raw
    if (
        isinstance(raw_text, dict)
        and "num_key_value_heads" not in raw_text
        and hasattr(text, "num_attention_heads")
    ):
        text.num_key_value_heads = text.num_attention_heads
    return config


def read_target_meta(
    path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> TargetMeta:
    """The target's shape from its config.json; the text config for VLM wrappers (e.g. qwen3_5)."""
    return _meta_of(_load_config(path, revision, trust_remote_code))


def _meta_of(config) -> TargetMeta:
    return meta_from_config(config.get_text_config(decoder=True).to_dict())


def target_embed_and_head(target: PreTrainedModel) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The loaded target's own embedding and lm_head weights [V, H] (shared, no copy): the same
    tensors ``load_embed_and_head`` reads from the checkpoint, without a second copy on the device."""
    try:
        emb, out = target.get_input_embeddings(), target.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    w_e, w_h = getattr(emb, "weight", None), getattr(out, "weight", None)
    if not isinstance(w_e, torch.Tensor) or not isinstance(w_h, torch.Tensor) or w_e.shape != w_h.shape:
        return None, None
    return w_e.detach(), w_h.detach()


def device_capacity(device: torch.device) -> tuple[int, str]:
    """``(bytes, what they are)`` a process may allocate on ``device``: the free memory of a CUDA
    device (``torch.cuda.mem_get_info``), the host's physical RAM on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM"


def target_size_problems(
    meta: TargetMeta, source: str, dtype: torch.dtype, device: torch.device, *, shards: int = 1
) -> list[str]:
    """Why the target whose ``config.json`` gave ``meta`` cannot be held on ``device`` in ``dtype``
    (the weight count of ``dflash.targets.families``; ``shards``: the ranks of a tensor-parallel
    replica, each holding its share); checked before anything is allocated."""
    per_param = torch.empty((), dtype=dtype).element_size() / shards
    problem = target_weights_problem(source, meta, per_param, *device_capacity(device))
    return [problem] if problem else []


def default_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """Public DFlash convention: n == 1 -> [L // 2]; else round(1 + i*(L-4)/(n-1)), i = 0..n-1.

    Python's ``round`` (half to even), as in z-lab/dflash and SpecForge.
    """
    if num_taps < 1:
        raise ValueError(f"target.num_taps={num_taps}: need at least one tap")
    if num_taps == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (num_taps - 1))) for i in range(num_taps)]


def resolve_layer_ids(cfg: TargetConfig, meta: TargetMeta) -> list[int]:
    """``cfg.layer_ids`` or the default formula, checked against the target's layer count."""
    explicit = cfg.layer_ids is not None
    num_taps = DEFAULT_NUM_TAPS if cfg.num_taps is None else cfg.num_taps
    ids = (
        [int(x) for x in cfg.layer_ids]
        if cfg.layer_ids is not None
        else default_layer_ids(meta.num_layers, num_taps)
    )
    where = f"target.layer_ids={ids}" if explicit else f"target.num_taps={num_taps} (default layer ids {ids})"
    fix = (
        tap_ids_fix(ids, meta.num_layers)
        if explicit
        else f"set target.layer_ids explicitly or a smaller target.num_taps for this {meta.num_layers}-layer target"
    )
    check_tap_ids(ids, meta.num_layers, where, fix)
    return ids


def tap_ids_fix(ids: list[int], num_layers: int) -> str:
    """The override that makes ``ids`` valid tap ids of a ``num_layers``-layer target: its layers
    inside the target, each once, in increasing order (the default when none is)."""
    kept = sorted({i for i in ids if 0 <= i < num_layers})
    if kept:
        return f"set target.layer_ids={kept}"
    return f"set target.layer_ids=null (the default taps of this {num_layers}-layer target)"


def check_tap_ids(ids: list[int], num_layers: int, where: str, fix: str) -> None:
    """Raise ``ValueError`` (``"{where}: ...; {fix}"``) unless ``ids`` are distinct layers in
    ``[0, num_layers)`` in increasing order (``dflash.config.checks.tap_ids_problem``)."""
    problem = tap_ids_problem([int(i) for i in ids], num_layers)
    if problem:
        raise ValueError(f"{where}: {problem}; {fix}")


def check_remote_code(cfg: TargetConfig) -> None:
    """trust_remote_code runs code from the hub: only allowed pinned to a full commit hash."""
    if cfg.trust_remote_code and (cfg.revision is None or not _COMMIT_RE.match(str(cfg.revision).lower())):
        raise ValueError(
            f"target.trust_remote_code=true needs target.revision pinned to a full 40-hex commit hash, got "
            f"target.revision={cfg.revision!r}; set target.revision=<commit sha> (or target.trust_remote_code=false)"
        )


def base_model(model: nn.Module) -> nn.Module:
    """The headless base model (``model.model``): decoder layers + final norm, no lm_head."""
    base = getattr(model, "model", None)
    if not isinstance(base, nn.Module):
        base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise TypeError(f"{type(model).__name__} has no headless base model (.model)")
    # A VLM wrapper (e.g. Qwen3_5ForConditionalGeneration) keeps the text model one level down.
    inner = getattr(base, "language_model", None)
    if not hasattr(base, "layers") and isinstance(inner, nn.Module):
        return inner
    return base


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: base model has no decoder layer list (.layers)")
    return layers


def load_target(
    cfg: TargetConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp_group: Any = None,
    *,
    decoding: bool = False,
) -> PreTrainedModel:
    """The frozen target ``*ForCausalLM``: eval, requires_grad off, on ``device`` (with
    ``target.random_weights``: built from config.json with random weights, no weights file read).

    ``tp_group``: the process group of this rank's tensor-parallel replica (``dflash.targets.tp``);
    with more than one rank the weights are DTensors sharded over it and each rank reads only its
    shard of the checkpoint. Every rank of the group must call this together. ValueError before
    anything is allocated when its config.json implies more weights than the device holds. The
    attention kernel is ``target.attn_implementation`` resolved for the device and the model
    (``dflash.config.resolve.target_attention``: auto is document-masked on CUDA); ``decoding``: the
    target will decode one sequence at a time with a cache (speculative decoding), which auto runs
    with SDPA.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    check_remote_code(cfg)
    t0 = time.perf_counter()
    tp_size = 1 if tp_group is None else tp_group.size()
    config = _load_config(cfg.path, cfg.revision, cfg.trust_remote_code)
    where = f"target.path={cfg.path} (config.json)"
    problems = target_size_problems(_meta_of(config), where, dtype, device, shards=tp_size)
    if problems:
        raise ValueError(problems[0])
    model_type = str(config.get_text_config(decoder=True).model_type)
    attn = target_attention(cfg, device.type, model_type, pack=False if decoding else None)
    if attn == "flex_attention" and device.type == "cpu":
        log.warning(
            "target.attn_implementation=flex_attention on CPU: torch 2.13's compiled CPU flex kernel gives "
            "wrong outputs on AVX2 code paths (tests/unit/test_target_attention.py); set "
            "target.attn_implementation=auto (SDPA on CPU)"
        )
    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn)
    sharding: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if tp_size > 1:
        kwargs["distributed_config"] = distributed_config(config.get_text_config(decoder=True), tp_size)
        sharding = replica_mesh(tp_group, device)
    if cfg.random_weights:
        torch.manual_seed(RANDOM_WEIGHTS_SEED)  # every rank builds the same weights
    with sharding:
        if cfg.random_weights and tp_size > 1:  # every tensor missing: initialised shard by shard
            text = config.get_text_config(decoder=True)
            model_cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
            model = model_cls.from_pretrained(None, config=text, state_dict={}, **kwargs)
        elif cfg.random_weights:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.path,
                config=config,
                revision=cfg.revision,
                trust_remote_code=cfg.trust_remote_code,
                **kwargs,
            )
    model.eval()
    model.requires_grad_(False)
    model.to(device)
    on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    on_meta += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if on_meta:
        raise RuntimeError(
            f"target {cfg.path}: {len(on_meta)} tensors left on the meta device, e.g. {on_meta[:3]}"
        )
    log.info(
        "loaded target %s (%s, %s attention) on %s%s: %s params, %.2f GiB %s on this rank, %.1fs",
        cfg.path,
        type(model).__name__,
        attn,
        device,
        f" (tensor parallel over {tp_size} ranks)" if tp_size > 1 else "",
        human_count(sum(p.numel() for p in model.parameters())),
        local_num_bytes(model) / 2**30,
        dtype,
        time.perf_counter() - t0,
    )
    kernels = install_varlen(model)
    if kernels is not None:
        log.info("linear-attention layers on packed rows: %s", kernels)
    return model


# ----------------------------------------------------------------------------------------------
# Embedding and lm_head by tensor name


def resolve_file(path: str, filename: str, revision: str | None) -> str | None:
    """Local file of ``filename`` in a checkpoint dir or hub repo (cache or download); None if absent."""
    if os.path.isdir(path):
        p = Path(path) / filename
        return str(p) if p.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(path, filename, revision=revision)
    except EntryNotFoundError:
        return None
    except LocalEntryNotFoundError:
        # Offline and not cached: absent from the cache is not proof of absence, unless the other
        # layout is cached; the caller reports both names if neither is found.
        return None


def _checkpoint_index(path: str, revision: str | None) -> dict[str, str]:
    """tensor name -> local safetensors file, reading only the index (sharded) or header (single)."""
    index_file = resolve_file(path, INDEX_FILE, revision)
    if index_file is not None:
        weight_map = json.loads(Path(index_file).read_text())["weight_map"]
        return {name: f"{os.path.dirname(index_file)}\0{shard}" for name, shard in weight_map.items()}
    single = resolve_file(path, SINGLE_FILE, revision)
    if single is None:
        raise FileNotFoundError(
            f"target checkpoint {path!r} (revision {revision}): neither {INDEX_FILE} nor {SINGLE_FILE} found"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_tensor(path: str, revision: str | None, location: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    if "\0" in location:  # sharded: "<dir of index>\0<shard file name>"
        folder, shard = location.split("\0", 1)
        file: str | None = os.path.join(folder, shard)
        if not os.path.isfile(str(file)):  # hub: shards are fetched on demand
            file = resolve_file(path, shard, revision)
            if file is None:
                raise FileNotFoundError(
                    f"target checkpoint {path!r}: shard {shard} (holding {name}) not found"
                )
    else:
        file = location
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def load_embed_and_head(
    path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding [V, H], lm_head [V, H])`` read by name from the target's safetensors, no model built.

    Reads only the two tensors (``safe_open`` + ``get_tensor``; with a sharded checkpoint only the
    shards holding them). A tied target (``tie_word_embeddings``) returns the embedding as head.
    Tensors come back in the checkpoint dtype on CPU.
    """
    meta = read_target_meta(path, revision=revision, trust_remote_code=trust_remote_code)
    where = _checkpoint_index(path, revision)
    embed_name = next((n for n in EMBED_NAMES if n in where), None)
    if embed_name is None:
        raise KeyError(f"target checkpoint {path!r}: no embedding tensor among {list(EMBED_NAMES)}")
    embed = _read_tensor(path, revision, where[embed_name], embed_name)
    if meta.tie_word_embeddings:
        head = embed
    else:
        head_name = next((n for n in HEAD_NAMES if n in where), None)
        if head_name is None:
            raise KeyError(
                f"target checkpoint {path!r}: tie_word_embeddings is false but no lm_head tensor among {list(HEAD_NAMES)}"
            )
        head = _read_tensor(path, revision, where[head_name], head_name)
    for what, t in (("embedding", embed), ("lm_head", head)):
        if t.dim() != 2 or t.shape[1] != meta.hidden_size:
            raise ValueError(
                f"target checkpoint {path!r}: {what} has shape {tuple(t.shape)}, expected [V, {meta.hidden_size}]"
            )
    if head.shape != embed.shape:
        raise ValueError(
            f"target checkpoint {path!r}: lm_head {tuple(head.shape)} != embedding {tuple(embed.shape)}"
        )
    return embed, head
