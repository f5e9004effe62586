"""Embedded corpus: stdlib prompts, responses = the target's greedy generation, built once."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.chat import prompt_ids
from dflash.data.embedded import build_embedded_corpus, make_prompts
from dflash.data.sources import load_eval_conversations

NUM_PROMPTS, MAX_NEW = 8, 16


@pytest.fixture(scope="module")
def corpus(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "corpus.jsonl"
    return build_embedded_corpus(
        tiny_target_dir, out, num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW, seed=5, device="cpu"
    )


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    return tok, model


def test_prompts_are_deterministic_stdlib_snippets():
    a, b = make_prompts(20, seed=1), make_prompts(20, seed=1)
    assert a == b and a != make_prompts(20, seed=2)
    assert len({p.split("\n", 1)[0] for p in a}) > 1  # several templates
    assert len({p.count("\n") for p in a}) > 3  # varied lengths


@pytest.fixture(scope="module")
def reference(corpus, target):
    """(messages, greedy ids) per corpus row: generate again, one prompt at a time, no padding."""
    tok, model = target
    eos = tok.eos_token_id
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny decode steps; more threads only contend on shared cores
    for line in corpus.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        p = torch.tensor([prompt_ids(tok, msgs)])
        with torch.inference_mode():
            out = model.generate(
                p,
                attention_mask=torch.ones_like(p),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )[0, p.shape[1] :].tolist()
        rows.append((msgs, out[: out.index(eos)] if eos in out else out))
    torch.set_num_threads(threads)
    return rows


def test_jsonl_assistant_is_the_greedy_generation(reference, target):
    tok, _ = target
    assert len(reference) == NUM_PROMPTS
    for msgs, generated in reference:
        assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[1]["content"]
        assert msgs[1]["content"] == tok.decode(generated, skip_special_tokens=False)


def test_training_sample_is_exactly_what_the_target_generated(corpus, reference, target, tmp_path):
    """The dataset built from the corpus holds prompt + the generated ids (+ eos when generation
    stopped there) with the loss mask on the response, and under teacher forcing every supervised
    token is the target's greedy token at that position: no BPE re-tokenization drift."""
    tok, model = target
    ds = build_or_load_dataset(
        DataConfig(path=str(corpus), cache_dir=str(tmp_path), max_length=512), tok, len(tok)
    )
    assert len(ds) == NUM_PROMPTS
    for k, (msgs, generated) in enumerate(reference):
        ids, mask = ds.sample(k)
        p = prompt_ids(tok, msgs)
        response = ids[len(p) :].tolist()
        assert ids[: len(p)].tolist() == p and not mask[: len(p)].any() and mask[len(p) :].all()
        assert response in (generated, generated + [tok.eos_token_id])
        with torch.inference_mode():
            greedy = model(ids.unsqueeze(0)).logits[0].argmax(-1)
        assert greedy[len(p) - 1 : -1].tolist() == response


def test_reused_when_identical_and_rebuilt_otherwise(corpus, tiny_target_dir):
    mtime = corpus.stat().st_mtime_ns
    build_embedded_corpus(
        tiny_target_dir, corpus, num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW, seed=5, device="cpu"
    )
    assert corpus.stat().st_mtime_ns == mtime
    meta = json.loads(corpus.with_name(corpus.name + ".meta.json").read_text())
    assert (
        meta["num_prompts"] == NUM_PROMPTS and meta["max_new_tokens"] == MAX_NEW and len(meta["target"]) == 64
    )
    other = corpus.with_name("other.jsonl")
    build_embedded_corpus(tiny_target_dir, other, num_prompts=3, max_new_tokens=4, seed=5, device="cpu")
    assert len(other.read_text().splitlines()) == 3


def test_dataset_from_embedded_path(tiny_target_dir, target, tmp_path):
    tok, _ = target
    cfg = DataConfig(
        path="embedded",
        cache_dir=str(tmp_path),
        max_length=512,
        embedded_num_prompts=6,
        embedded_max_new_tokens=4,
        num_eval_prompts=2,
    )
    with pytest.raises(ValueError, match="target_dir"):
        build_or_load_dataset(cfg, tok, len(tok))
    ds = build_or_load_dataset(cfg, tok, len(tok), target_dir=tiny_target_dir)
    assert ds.num_source == 4 and len(ds) == 4 and ds.sample_ids.tolist() == [0, 1, 2, 3]
    evals = load_eval_conversations(cfg, target_dir=tiny_target_dir)
    assert len(evals) == 2 and all(m[-1]["role"] == "assistant" for m in evals)
