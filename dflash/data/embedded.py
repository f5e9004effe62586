"""The embedded default corpus: stdlib code prompts, responses regenerated greedily by the target.

Real DFlash data is made by regenerating the assistant responses with the target, so that the
training labels follow the target's own (greedy) distribution. This module does the same offline:
prompts are snippets cut from CPython's standard-library sources (``dflash.data.stdlib.code_snippets``)
wrapped in a few instruction templates, and the target answers them with batched greedy ``generate``.
The result is a chat JSONL (``{"messages": [user, assistant]}`` per line) that also carries the
exact token ids (``input_ids``: prompt + generated response, + eos when generation stopped there;
``loss_mask``: 1 on the response), so every training label is the target's own greedy token.

The build is deterministic (seed, stdlib files, target weights), atomic, guarded by a file lock
and idempotent: a ``<out>.meta.json`` sidecar records the parameters, a fingerprint of the
target and the size and sha256 of the corpus, and an identical request reuses the file after
checking it against them (a truncated or edited corpus is named in a warning and rebuilt).

The training sample can still differ from what the target generated only through numerics:
batched, left-padded, KV-cached decoding and the full-sequence prefill of training are different
kernels, so near-ties of the argmax can flip.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dflash.data.chat import prompt_ids
from dflash.data.regenerate.hf_backend import generate
from dflash.data.stdlib import code_snippets
from dflash.files import atomic_file, atomic_write, cache_fix, digest_problems, file_digest, file_lock

log = logging.getLogger(__name__)

CORPUS_VERSION = 4
_TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
_FULL_HASH_LIMIT = 256 << 20


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's config, tokenizer and weight files (big files: size + head + tail)."""
    target_dir = Path(target_dir)
    files = [target_dir / f for f in _TARGET_FILES if (target_dir / f).exists()]
    files += sorted(target_dir.glob("*.safetensors")) + sorted(target_dir.glob("*.bin"))
    if not files:
        raise ValueError(f"{target_dir} has no model or tokenizer files; is target.path right?")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _FULL_HASH_LIMIT:
                h.update(fh.read())
            else:
                h.update(fh.read(1 << 20))
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()


def embedded_corpus_path(
    cache_root: Path,
    target_dir: str | os.PathLike,
    num_prompts: int,
    max_new_tokens: int,
    seed: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Path:
    """Where the corpus for these parameters lives under the data cache."""
    params: list[Any] = [str(Path(target_dir).resolve()), num_prompts, max_new_tokens, seed]
    if chat_template_kwargs:
        params.append(chat_template_kwargs)
    key = json.dumps(params, sort_keys=True)
    return Path(cache_root) / "embedded" / f"corpus-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"


def _reusable(out_path: Path, meta_path: Path, want: dict[str, Any], *, warn: bool) -> bool:
    """Whether ``out_path`` is a complete, undamaged corpus built with ``want`` (its sidecar at
    ``meta_path`` records the parameters and the corpus digest); damage is logged when ``warn``."""
    if not out_path.exists() or not meta_path.exists():
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        problems = [f"{meta_path}: unreadable ({exc})"]
    else:
        if not isinstance(meta, dict) or {k: meta.get(k) for k in want} != want:
            return False
        problems = digest_problems(
            out_path.parent, {out_path.name: meta["corpus"]} if "corpus" in meta else None
        )
    if problems and warn:
        log.warning("embedded corpus %s is damaged, rebuilding it: %s", out_path, "; ".join(problems))
    return not problems


def make_prompts(num_prompts: int, seed: int) -> list[str]:
    """num_prompts user messages: a few lines of a stdlib file of ``corpus_files`` in a random
    template (``code_snippets``). Deterministic for a seed and a Python installation."""
    return [user for user, _ in code_snippets(num_prompts, seed)]


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Temporarily run torch CPU ops on n threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_embedded_corpus(
    target_dir: Path,
    out_path: Path,
    *,
    num_prompts: int,
    max_new_tokens: int,
    seed: int,
    chat_template_kwargs: dict[str, Any] | None = None,
    device: str | None = None,
) -> Path:
    """Build (or reuse) the embedded chat JSONL at ``out_path`` with the target at ``target_dir``.

    Each line is ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``; the
    assistant content is the target's greedy response (fp32, batched, left-padded, stop at eos,
    at most max_new_tokens), decoded with special tokens kept; the prompts are rendered with
    ``chat_template_kwargs`` (recorded in the sidecar). Safe to call from every rank: one
    builds under a file lock, the others wait and reuse. ``device``: None = cuda when available,
    else cpu. On CPU generation runs on one thread: these small decode steps gain nothing from
    more, and with the cores shared (other ranks, other jobs) 2 threads measured 5-8x slower.
    """
    target_dir, out_path = Path(target_dir), Path(out_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if num_prompts < 1 or max_new_tokens < 1:
        raise ValueError(
            f"data.embedded_num_prompts={num_prompts} and data.embedded_max_new_tokens="
            f"{max_new_tokens} must be >= 1"
        )
    meta_path = out_path.with_name(out_path.name + ".meta.json")
    kwargs = dict(chat_template_kwargs or {})
    want = {
        "version": CORPUS_VERSION,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "python": sys.version.split()[0],
        "device": torch.device(device).type,
        "target": target_fingerprint(target_dir),
        "chat_template_kwargs": kwargs,
    }

    if _reusable(out_path, meta_path, want, warn=True):
        return out_path
    with file_lock(out_path.parent / f".{out_path.name}.lock"):
        if _reusable(out_path, meta_path, want, warn=False):
            return out_path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(device)
        users = make_prompts(num_prompts, seed)
        convs = [[{"role": "user", "content": u}] for u in users]
        prompts = [prompt_ids(tokenizer, c, **kwargs) for c in convs]
        with _torch_threads(1 if torch.device(device).type == "cpu" else torch.get_num_threads()):
            responses, stops = generate(model, tokenizer, prompts, max_new_tokens)
        del model
        fix = cache_fix("data.cache_dir")
        with atomic_file(out_path, fix=fix) as fh:
            for conv, prompt, ids, stop in zip(convs, prompts, responses, stops, strict=True):
                text = tokenizer.decode(ids, skip_special_tokens=False)
                response = ids if stop is None else ids + [stop]
                fh.write(
                    json.dumps(
                        {
                            "messages": conv + [{"role": "assistant", "content": text}],
                            "input_ids": prompt + response,
                            "loss_mask": [0] * len(prompt) + [1] * len(response),
                        }
                    )
                    + "\n"
                )
        atomic_write(meta_path, json.dumps({**want, "corpus": file_digest(out_path)}, indent=1), fix=fix)
        log.info(
            "embedded corpus: %d prompts x <=%d tokens (%d finished with eos) in %.1fs -> %s",
            num_prompts,
            max_new_tokens,
            sum(s is not None for s in stops),
            time.perf_counter() - t0,
            out_path,
        )
    return out_path
