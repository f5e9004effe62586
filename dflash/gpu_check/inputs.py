"""The inputs of the training parts (colocated and split): a random-weights target directory (config.json of a
target shape and the tiny tokenizer) and chat data cut from CPython's stdlib sources."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.config import TinyTargetConfig
from dflash.gpu_check.profiles import REPO


@dataclass
class Inputs:
    """What setup wrote for the colocated and split parts."""

    target_dir: Path
    data_path: Path
    num_samples: int
    shape: dict[str, Any]
    vocab_used: int
    """Token ids the tokenizer produces (the probe draws below it)."""


def _tokenizer_into(out: Path) -> str:
    """The tiny byte-level BPE into ``out``: copied from the cached tiny target when it is built
    (``$DFLASH_CACHE_DIR/tiny_targets/qwen3-...``, conf/target/tiny.yaml), else trained on the stdlib
    sources (seconds)."""
    from transformers import AutoTokenizer

    from dflash.targets.tiny import build_tokenizer

    cache = Path(os.environ.get("DFLASH_CACHE_DIR", ".cache/dflash"))
    src = (cache if cache.is_absolute() else REPO / cache) / TinyTargetConfig().cache_subdir()
    if (src / "tokenizer.json").is_file():
        for f in src.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja"):
                shutil.copy2(f, out / f.name)
        try:
            AutoTokenizer.from_pretrained(out)
            return f"copied from {src}"
        except (OSError, ValueError):
            pass
    build_tokenizer(out)
    return "built (stdlib BPE)"


def target_shape(name: str) -> dict[str, Any]:
    """The ``shape:`` block of ``conf/target/<name>.yaml``."""
    from omegaconf import OmegaConf

    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "target" / f"{name}.yaml").shape)
    assert isinstance(shape, dict)
    return {str(k): v for k, v in shape.items()}


def write_target_dir(out: Path, shape: dict[str, Any], max_positions: int) -> str:
    """config.json of ``shape`` (``TargetShape`` fields; its family's config, e.g. a hybrid
    ``qwen3_5_text`` with its Gated DeltaNet layers, ``dflash.targets.families.fake_config``) + the
    tiny tokenizer: with ``target.random_weights=true`` a usable target without any weights file.
    Returns how the tokenizer came to be."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.config import TargetShape
    from dflash.targets.families import fake_config

    out.mkdir(parents=True, exist_ok=True)
    how = _tokenizer_into(out)
    tok = AutoTokenizer.from_pretrained(out)
    model_type, kwargs = fake_config(TargetShape(**shape), max_positions)
    if model_type == "qwen3":
        kwargs.update(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6)
    config = AutoConfig.for_model(
        model_type,
        **kwargs,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    config.save_pretrained(out)
    return how


def write_chat_data(path: Path, target_dir: Path, num_samples: int, prompt: int, response: int) -> int:
    """``num_samples`` conversations of ``prompt`` user + ``response`` assistant tokens of stdlib source
    text (cut in tokens, so every sample has about the same length); returns the ids in use."""
    from transformers import AutoTokenizer

    from dflash.data.stdlib import stdlib_text_files

    tok = AutoTokenizer.from_pretrained(target_dir)
    per = prompt + response
    need = num_samples * per
    ids: list[int] = []
    for f in stdlib_text_files():
        ids += tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    with open(path, "w") as fh:
        for i in range(num_samples):
            start = (i * per) % max(1, len(ids) - per)
            user = tok.decode(ids[start : start + prompt])
            assistant = tok.decode(ids[start + prompt : start + per])
            msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return len(tok)
