"""The one place that turns a config's ``auto`` choices and paths into concrete values.

- ``device_kind``: ``auto``/``cpu``/``cuda`` -> ``cpu`` or ``cuda`` (auto: cuda when torch sees a GPU);
- ``resolve_device``: that kind as this process's ``torch.device`` (``cuda:{local_rank}``, set current);
- ``torch_dtype``: ``auto``/``float32``/``bfloat16``/``float16`` -> a ``torch.dtype`` for a device
  (auto: bfloat16 on CUDA, float32 on CPU, where bf16 matmul is much slower than fp32);
- ``drafter_attention``: ``drafter.attention`` for a device kind (auto: flex on CUDA, sdpa on CPU);
- ``target_attention``: ``target.attn_implementation`` for a device kind and a model (auto on
  CUDA: a document-masked kernel, flash_attention_2 when installed, else flex_attention, for packed
  rows; sdpa for padded rows and on CPU);
- ``resolve_path``: a local path made absolute against the launch directory (Hydra does not
  chdir), ``~`` expanded; a hub id is returned unchanged.

Every app and the training job use these; nothing else resolves a device, a dtype or a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dflash.config.schema import TargetConfig


def device_kind(device: str) -> str:
    """``auto``, ``cpu`` or ``cuda`` resolved to ``cpu`` or ``cuda`` (auto: cuda when torch sees a GPU)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str, local_rank: int = 0, *, field: str = "topology.device") -> torch.device:
    """This process's device for the setting ``device`` (auto, cpu or cuda): ``cuda:{local_rank}``
    (made the current CUDA device) or ``cpu``. ValueError naming ``field`` when CUDA is asked for
    but absent, or when ``local_rank`` has no GPU."""
    import torch

    kind = device_kind(str(device))
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"{field}={device!r}: use auto, cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}=cuda but CUDA is not available here; set {field}=cpu (or auto)")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this node has {count} CUDA devices; start at most {count} processes per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; otherwise the named torch dtype."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def drafter_attention(attention: str, device: str) -> str:
    """``drafter.attention`` resolved for a ``cpu``/``cuda`` device: auto is flex on CUDA, sdpa on CPU."""
    if attention == "auto":
        return "flex" if device == "cuda" else "sdpa"
    return attention


def drafter_sharded(shard: str, num_drafters: int) -> bool:
    """``drafter.shard`` takes effect: FSDP2 over the drafters (``optimizer`` or ``full``, and more
    than one drafter); else every drafter holds the whole state (replicated)."""
    return str(shard) != "none" and num_drafters > 1


def target_attention(
    cfg: TargetConfig, device: str, model_type: str | None = None, *, pack: bool | None = None
) -> str:
    """``target.attn_implementation`` resolved for a ``cpu``/``cuda`` device (transformers' name), the
    target's ``model_type`` (None: taken to support every kernel) and the rows it will run (``pack``:
    default ``target.pack``; decoding runs one sequence per row, ``pack=False``).

    auto computes only the pairs inside each document on CUDA. Packed rows (``target.pack``) need a
    kernel that knows the documents: ``flash_attention_2`` when the flash-attn package is installed,
    the rows are 16-bit and transformers supports it for the model, else transformers'
    ``flex_attention`` (torch only) where the model supports it, else ``sdpa`` (every pair of the row).
    Padded rows hold one document each: ``sdpa`` (``is_causal``, see ``dflash.targets.attention``).
    auto on CPU is ``sdpa``; explicit names are kept.
    """
    name = str(cfg.attn_implementation)
    if name != "auto":
        return name
    if device != "cuda" or not (cfg.pack if pack is None else pack):
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    half = str(cfg.dtype) in ("auto", "bfloat16", "float16")
    if half and _supports(model_type, "_supports_flash_attn") and is_flash_attn_2_available():
        return "flash_attention_2"
    return "flex_attention" if _supports(model_type, "_supports_flex_attn") else "sdpa"


def _supports(model_type: str | None, flag: str) -> bool:
    """Whether transformers' ``*ForCausalLM`` of ``model_type`` sets ``flag`` (unknown: True)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    cls = getattr(transformers, name, None) if name else None
    return cls is None or bool(getattr(cls, flag, True))


def resolve_path(path: str) -> str:
    """A local path made absolute against the launch directory (``~`` expanded); a hub id (no
    such local path, not starting with ``.``, ``/`` or ``~``) is returned unchanged."""
    from hydra.utils import to_absolute_path

    p = Path(path).expanduser()
    local = p if p.is_absolute() else Path(to_absolute_path(str(p)))
    return str(local) if local.exists() or path.startswith((".", "/", "~")) else path
