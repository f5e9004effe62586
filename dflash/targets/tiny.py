"""Build a tiny random-init target and its tokenizer fully offline.

The embedded default and the tests need a real transformers checkpoint without a network: a
byte-level BPE trained on CPython's own standard-library sources (always present), a ChatML chat
template, and a random-init ``*ForCausalLM`` saved with ``save_pretrained`` so that the real
``from_pretrained`` path runs. The build is deterministic (same files, same seed) and guarded by a
file lock, so every rank may call ``ensure_tiny_target`` at once and only one builds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash.config import TinyTargetConfig
from dflash.data.stdlib import stdlib_text_files
from dflash.files import file_lock

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 2048
_DONE = "dflash_tiny_done.json"


def build_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB):
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


def build_model(spec: TinyTargetConfig, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """A random-init ``*ForCausalLM`` from ``spec`` (fp32, untied head so greedy text is not an echo).

    ``qwen3_5_text`` is a hybrid target (Qwen3.5/3.6 text model: gated-delta-net linear attention with
    a full-attention layer every 4th), its linear heads sized like the attention heads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    linear = {}
    if spec.model_type == "qwen3_5_text":
        linear = dict(
            linear_num_key_heads=spec.num_kv_heads,
            linear_num_value_heads=spec.num_heads,
            linear_key_head_dim=spec.head_dim,
            linear_value_head_dim=spec.head_dim,
        )
    cfg = AutoConfig.for_model(
        spec.model_type,
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
        **linear,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def ensure_tiny_target(path: str | os.PathLike, spec: TinyTargetConfig) -> Path:
    """Build the tiny target + tokenizer at ``path`` unless a complete build with ``spec`` is there.

    Safe to call from every rank at once: one builds under a file lock, the others wait and reuse.
    Returns the directory, loadable with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.
    """
    out = Path(path).resolve()
    want = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}, "version": 1}
    with file_lock(out.parent / f".{out.name}.lock"):
        done = out / _DONE
        if done.exists() and json.loads(done.read_text()) == want:
            return out
        out.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer(out)
        vocab = len(tok) + spec.extra_vocab
        model = build_model(spec, vocab, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
        model.save_pretrained(out)
        done.write_text(json.dumps(want))
    return out
