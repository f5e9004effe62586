"""Build a tiny target and its tokenizer fully offline: a small language model of Python code.

The embedded default and the tests need a real transformers checkpoint without a network: a
byte-level BPE trained on CPython's own standard-library sources (always present), a ChatML chat
template, and a small ``*ForCausalLM`` trained for a fixed number of steps on chat samples cut
from a few of those sources ("Continue this code: <lines>" -> the next lines, up to a blank line),
saved with ``save_pretrained`` so that the real ``from_pretrained`` path runs. Its greedy answers
to the embedded prompts (cut from the same files) are therefore code that often ends its turn, not
repeated tokens, and the drafter's acceptance figures mean something.

The build is keyed on the whole spec and guarded by a file lock, so every rank may call
``ensure_tiny_target`` at once and only one builds; conf/target/tiny.yaml puts each spec in its own
directory (``TinyTargetConfig.cache_subdir``), so switching between specs never rebuilds one. A
build that trains shows a progress bar on the console of the process that builds. The default spec
(conf/target/tiny.yaml: 400 steps of 4 x 128 tokens) is not trained where it runs: its build ships
with the package (``prebuilt/``, made once by ``scripts/build_tiny_prebuilt.py``) and is copied into
place, checked against the digests it was shipped with. Training on the machine would give every CPU its own
target (its float sums differ from the first step: AVX2 and AVX-512 kernels, thread counts), and so
its own corpus, loss curve and demo figures; the shipped one is the same everywhere. Any other spec
is trained here (one CPU thread, deterministic on one machine).

The build only ever writes a directory the project owns: :func:`tiny_target_path` builds into
``target.path`` only when it is a new (or empty) directory under ``paths.cache_dir`` or an earlier
build (its marker, ``dflash_tiny_done.json``, is there); any other path is the user's model and is
loaded as it is. The marker records the size and sha256 of every file of the build; a reuse checks
them and rebuilds a damaged build (e.g. weights overwritten with NaN) instead of loading it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash.config import TargetConfig, TinyTargetConfig
from dflash.data.chat import render
from dflash.data.stdlib import code_snippets, stdlib_text_files
from dflash.files import atomic_directory, cache_fix, digest_files, digest_problems, file_lock
from dflash.metrics import progress_bar
from dflash.targets.families import FAMILIES, family_of

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 2048
BUILD_VERSION = 2  # 2: trained weights
_DONE = "dflash_tiny_done.json"
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
"""The shipped build of the default spec: its files and ``dflash_tiny_done.json`` (spec, version,
digests, and how it was made)."""
_MAX_ANSWER_LINES = 12
_WARMUP_FRACTION = 0.1


def build_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """Train a byte-level BPE on stdlib sources and save it (with a ChatML template) to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in stdlib_text_files()], trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    return hf


def model_kwargs(spec: TinyTargetConfig) -> dict[str, Any]:
    """The config fields of ``spec`` beyond the dense ones: its family's (``dflash.targets.families``:
    linear-attention heads sized like the attention heads, the experts)."""
    family = family_of(spec.model_type)
    if family.moe != (spec.num_experts > 0):
        moe_types = [t for f in FAMILIES if f.moe for t in f.model_types]
        raise ValueError(
            f"target.tiny.model_type={spec.model_type} with target.tiny.num_experts={spec.num_experts}: "
            f"MoE types {moe_types} need num_experts > 0, the others 0"
        )
    return family.tiny_kwargs(spec)


def build_model(spec: TinyTargetConfig, vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    """A random-init ``*ForCausalLM`` from ``spec`` (fp32, untied head so greedy text is not an echo),
    with its family's fields (:func:`model_kwargs`): ``qwen3_5_text`` is a hybrid target (Qwen3.5/3.6
    text model: gated-delta-net linear attention with a full-attention layer every 4th), the MoE types
    route every token to ``num_experts_per_tok`` of ``num_experts`` experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=4096,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    cfg = AutoConfig.for_model(spec.model_type, **{**kwargs, **model_kwargs(spec)})
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def training_stream(tokenizer: Any, seed: int) -> Iterator[int]:
    """Endless token ids of chat samples (user: a stdlib snippet in a prompt template, assistant:
    the next lines of the file up to a blank line), each rendered with the chat template, concatenated."""
    batch = 256
    for block in range(1 << 30):
        for user, answer in code_snippets(
            batch, seed * 1_000_003 + block, max_answer_lines=_MAX_ANSWER_LINES
        ):
            msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            yield from tokenizer(render(tokenizer, msgs), add_special_tokens=False)["input_ids"]


def train(model: Any, tokenizer: Any, spec: TinyTargetConfig) -> list[float]:
    """Next-token training of ``model`` in place: ``spec.train_steps`` AdamW steps on
    ``train_batch_size`` rows of ``train_seq_len`` tokens cut from :func:`training_stream`, linear
    warmup then cosine decay of ``train_lr``, gradient clipping at 1. One CPU thread (deterministic
    and, on shared cores, not slower), a progress bar on the console (whichever rank builds: the
    others wait on the lock). Returns the loss of every step."""
    torch.manual_seed(spec.seed)
    stream = training_stream(tokenizer, spec.seed)
    rows, width = spec.train_batch_size, spec.train_seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, int(_WARMUP_FRACTION * spec.train_steps))

    def lr_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.train_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses: list[float] = []
    t0 = time.perf_counter()
    model.train()
    desc = f"tiny target {spec.model_type}: training (once per spec)"
    try:
        with progress_bar(spec.train_steps, 0, True, desc=desc) as bar:
            for step in range(spec.train_steps):
                x = torch.tensor([next(stream) for _ in range(rows * width)]).view(rows, width)
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                assert bar is not None
                bar.update(1)
                if (step + 1) % 100 == 0 or step + 1 == spec.train_steps:
                    recent = losses[-100:]
                    bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
                    log.info(
                        "tiny target: step %d/%d, loss %.3f (mean of the last %d), %.0f s",
                        step + 1,
                        spec.train_steps,
                        sum(recent) / len(recent),
                        len(recent),
                        time.perf_counter() - t0,
                    )
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return losses


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _is_new(path: Path) -> bool:
    """Nothing there to overwrite: no such path, or an empty directory."""
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def _load_as_is(path: str | os.PathLike, why: str) -> None:
    log.warning(
        "target.path=%s is %s: loading it as it is and ignoring target.tiny (set target.tiny=null to "
        "silence this); nothing is written there",
        path,
        why,
    )


def tiny_target_path(target: TargetConfig, path: str, cache_dir: str | os.PathLike) -> str:
    """The directory (or hub id) to load the target from, ``path`` being the resolved ``target.path``.

    With ``target.tiny`` set, the tiny target is built (or its earlier build checked) at ``path``
    only when the project owns that directory: it holds the marker of an earlier build, or it is a
    new or empty directory under ``cache_dir`` (``paths.cache_dir``, where conf/target/tiny.yaml
    puts it). Any other path is the user's model, a hub id or a typo: returned unchanged, to be
    loaded as it is (a missing directory is then named by the loader), with a warning that
    ``target.tiny`` is ignored; nothing is written there. Without ``target.tiny``: ``path``."""
    if target.tiny is None:
        return path
    out = Path(path).expanduser().resolve()
    root = Path(cache_dir).expanduser().resolve()
    if (out / _DONE).is_file() or (_is_within(out, root) and _is_new(out)):
        return str(ensure_tiny_target(out, target.tiny))
    _load_as_is(
        path,
        f"not a tiny target built by dflash (no {_DONE}) nor a new directory under paths.cache_dir={root}",
    )
    return path


def prebuilt_marker(want: dict[str, Any]) -> dict[str, Any] | None:
    """The marker of the shipped build when it was made for ``want`` (spec key and version), else None."""
    try:
        marker = json.loads((PREBUILT_DIR / _DONE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or {k: marker.get(k) for k in want} != want:
        return None
    return marker


def _install_prebuilt(tmp: Path, marker: dict[str, Any]) -> None:
    """Check every shipped file against its digest, then copy the build into ``tmp``."""
    import shutil

    problems = digest_problems(PREBUILT_DIR, marker["files"])
    if problems:
        raise RuntimeError(
            f"the shipped tiny target in {PREBUILT_DIR} is damaged ({'; '.join(problems)}): reinstall dflash"
        )
    for name in marker["files"]:
        shutil.copyfile(PREBUILT_DIR / name, tmp / name)
    (tmp / _DONE).write_text(json.dumps(marker, indent=1))


def build_tiny_target(out: Path, spec: TinyTargetConfig) -> dict[str, Any]:
    """Train the tiny target of ``spec`` and its tokenizer into the empty directory ``out``; returns
    the marker written there (spec key, version, final training loss, file digests)."""
    tok = build_tokenizer(out)
    vocab = len(tok) + spec.extra_vocab
    model = build_model(spec, vocab, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    losses = train(model, tok, spec) if spec.train_steps > 0 else []
    model.save_pretrained(out)
    final_loss = sum(losses[-50:]) / max(len(losses[-50:]), 1)
    files = digest_files(out, sorted(p.name for p in out.iterdir() if p.is_file()))
    marker = {"spec": spec.key(), "version": BUILD_VERSION, "final_loss": final_loss, "files": files}
    (out / _DONE).write_text(json.dumps(marker, indent=1))
    return marker


def _reusable(out: Path, want: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete, undamaged build of ``want`` (a damaged one is logged)."""
    done = out / _DONE
    if not done.is_file():
        return False
    try:
        marker = json.loads(done.read_text())
    except (OSError, ValueError) as exc:
        log.warning("tiny target %s: unreadable marker %s (%s); rebuilding", out, done, exc)
        return False
    if not isinstance(marker, dict) or {k: marker.get(k) for k in want} != want:
        return False
    problems = digest_problems(out, marker.get("files"))
    if problems:
        log.warning("tiny target %s is damaged, rebuilding it: %s", out, "; ".join(problems))
    return not problems


def ensure_tiny_target(path: str | os.PathLike, spec: TinyTargetConfig) -> Path:
    """Build the tiny target + tokenizer at ``path`` unless a complete, undamaged build with
    ``spec`` is there (every file is checked against the sizes and sha256 its marker recorded).

    The default spec is copied from the shipped build (:data:`PREBUILT_DIR`), any other is trained.
    Only writes a directory it owns: a new or empty one, or an earlier build (its marker is there).
    A directory holding other files is someone's model: it is returned unchanged (to be loaded as
    it is) with a warning, never written. The build is made in a temp sibling and put in place
    whole (``atomic_directory``). Safe to call from every rank at once: one builds under a file
    lock, the others wait and reuse. Returns the directory, loadable with
    ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.
    """
    out = Path(path).resolve()
    if not (out / _DONE).is_file() and not _is_new(out):
        _load_as_is(path, f"a directory no tiny-target build wrote (no {_DONE} there)")
        return out
    want = {"spec": spec.key(), "version": BUILD_VERSION}
    with file_lock(out.parent / f".{out.name}.lock"):
        if _reusable(out, want):
            return out
        t0 = time.perf_counter()
        shipped = prebuilt_marker(want)
        with atomic_directory(out, fix=cache_fix("paths.cache_dir")) as tmp:
            if shipped is not None:
                _install_prebuilt(tmp, shipped)
            else:
                build_tiny_target(tmp, spec)
        if shipped is not None:
            how = "copied the shipped build"
        elif spec.train_steps > 0:
            how = f"built and trained ({spec.train_steps} steps)"
        else:
            how = "built untrained (target.tiny.train_steps=0: random weights)"
        log.info("tiny target at %s: %s in %.0f s", out, how, time.perf_counter() - t0)
    return out
