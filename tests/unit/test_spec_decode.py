"""Greedy DFlash speculative decoding on the tiny target: block size 1 == HF generate, lossless with
any drafter, acceptance bookkeeping, cache lengths, drafts == an uncached reference; and on a tiny
hybrid Qwen3.5 target (linear attention, rolled back by snapshot + replay): lossless, reports tau."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash.drafter.arch import DrafterArch, rope_from_config
from dflash.drafter.model import DFlashDraftModel
from dflash.eval.spec_decode import GenerationResult, StepTrace, accepted_prefix, speculative_generate
from dflash.eval.target_cache import TargetCache

LAYER_IDS = [1, 2, 4]
TEXTS = ["def foo(x):\n    return", "import os\nimport", "class A:", "for i in range(10):\n"]
N = 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _env(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.targets.loader import load_embed_and_head

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    embed, head = load_embed_and_head(str(target_dir))
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    return target, tok, embed, head, prompts


@pytest.fixture(scope="module")
def env(tiny_target_dir):
    return _env(tiny_target_dir)


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_target_dir):
    return _env(tiny_hybrid_target_dir)


@pytest.fixture(scope="module")
def repeating_env(env):
    """``env`` with the tiny target's random initialisation instead of its trained weights: its greedy
    output has long runs of one repeated token (the trained model's has none), which the
    acceptance-length test needs."""
    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import build_model

    _, tok, _, _, prompts = env
    end = tok.convert_tokens_to_ids("<|im_end|>")
    target = build_model(TinyTargetConfig(), env[0].config.vocab_size, end, tok.pad_token_id)
    embed = target.get_input_embeddings().weight.detach()
    return target, tok, embed, target.get_output_embeddings().weight.detach(), prompts


def make_drafter(target, tok, block_size: int, seed: int = 0, num_layers: int = 1) -> DFlashDraftModel:
    c = target.config
    rope, partial = rope_from_config(c.to_dict())
    arch = DrafterArch(
        hidden_size=c.hidden_size,
        intermediate_size=256,
        num_layers=num_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        target_layer_ids=LAYER_IDS,
        block_size=block_size,
        mask_token_id=len(tok),
        rope_parameters=rope,
        partial_rotary_factor=partial,
    )
    model = DFlashDraftModel(arch)
    model.reset_parameters(seed=seed)
    return model.eval()


def greedy(env, prompt, n=N, eos=frozenset()) -> GenerationResult:
    target = env[0]
    return speculative_generate(
        target,
        None,
        None,
        None,
        prompt,
        max_new_tokens=n,
        eos_token_ids=set(eos),
        layer_ids=LAYER_IDS,
        block_size=1,
    )


def spec(env, drafter, prompt, block_size, n=N, eos=frozenset(), head=None, on_step=None) -> GenerationResult:
    target, _, embed, thead, _ = env
    return speculative_generate(
        target,
        drafter,
        embed,
        thead if head is None else head,
        prompt,
        max_new_tokens=n,
        eos_token_ids=set(eos),
        layer_ids=LAYER_IDS,
        block_size=block_size,
        on_step=on_step,
    )


def hf_generate(target, prompt, n, eos_id, pad_id) -> list[int]:
    out = target.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def check_bookkeeping(res: GenerationResult, block_size: int, n: int) -> None:
    assert res.wall_time_s >= res.prefill_time_s > 0
    if res.num_steps == 0:  # the prefill's token was already an eos (or n == 1)
        assert len(res.output_ids) == 1 and res.num_target_forwards == 1
        return
    assert all(1 <= a <= block_size for a in res.accept_lengths)
    assert res.num_target_forwards == 1 + res.num_steps + res.num_replay_forwards
    assert res.tau == pytest.approx(sum(res.accept_lengths) / len(res.accept_lengths))
    assert res.tau >= 1.0
    # every step but the last contributes accepted + 1 tokens; the last one may be cut (eos / n)
    assert 1 + sum(res.accept_lengths[:-1]) < len(res.output_ids) <= 1 + sum(res.accept_lengths)
    assert len(res.output_ids) <= n


# ------------------------------------------------------------------------------ acceptance rule


def test_accepted_prefix_on_hand_made_blocks():
    t = torch.tensor
    # block [x, d1, d2, d3]; predictions y0..y3: d_j accepted while d_j == y_{j-1}
    assert accepted_prefix(t([5, 1, 2, 3]), t([9, 9, 9, 9])) == 0  # d1 != y0
    assert accepted_prefix(t([5, 1, 2, 3]), t([1, 2, 7, 4])) == 2  # d3 != y2
    assert accepted_prefix(t([5, 1, 2, 3]), t([1, 2, 3, 4])) == 3  # all B-1 accepted
    assert accepted_prefix(t([5, 1, 2, 3]), t([1, 7, 3, 4])) == 1  # a later match after a miss does not count
    assert accepted_prefix(t([5]), t([6])) == 0  # block size 1
    with pytest.raises(ValueError):
        accepted_prefix(t([5, 1]), t([1, 2, 3]))


def test_rewind_crops_an_attention_only_cache(env):
    target, _, _, _, prompts = env
    cache = TargetCache(target, rollback=True)
    assert not cache.has_linear_attention
    with torch.inference_mode():
        target(input_ids=torch.tensor([prompts[0]]), cache=cache.cache, use_cache=True)
    full = cache.cache.layers[0].keys.clone()
    assert cache.rewind(5) == 0  # nothing to replay: the crop alone undoes the tokens
    assert cache.seq_length() == 5
    assert torch.equal(cache.cache.layers[0].keys, full[:, :, :5])
    assert cache.rewind(5) == 0  # no-op
    with pytest.raises(ValueError):
        cache.rewind(6)


def test_rewind_restores_linear_attention_state_and_asks_for_a_replay(hybrid):
    """Prompt, then 6 drafted tokens of which 2 are kept: restoring the marked state and replaying the
    2 tokens gives the same next-token logits as a cache that only ever saw prompt + those 2 tokens."""
    target, _, _, _, prompts = hybrid
    prompt, drafts = prompts[0], torch.tensor([[5, 17, 29, 41, 53, 65]])
    P = len(prompt)
    probe = torch.tensor([[7]])
    cache = TargetCache(target, rollback=True)
    assert cache.has_linear_attention
    with torch.inference_mode():
        target(input_ids=torch.tensor([prompt]), cache=cache.cache, use_cache=True)
        cache.mark(P)
        target(input_ids=drafts, cache=cache.cache, use_cache=True)
        assert cache.rewind(P + 2) == 2 and cache.seq_length() == P
        target(input_ids=drafts[:, :2], cache=cache.cache, use_cache=True)
        assert cache.seq_length() == P + 2
        got = target(input_ids=probe, cache=cache.cache, use_cache=True).logits
        straight = TargetCache(target, rollback=True)
        target(
            input_ids=torch.tensor([prompt + drafts[0, :2].tolist()]), cache=straight.cache, use_cache=True
        )
        want = target(input_ids=probe, cache=straight.cache, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ block size 1


def test_block_size_1_reproduces_hf_generate(env):
    target, tok, _, _, prompts = env
    eos_id = target.generation_config.eos_token_id
    for prompt in prompts:
        ref = hf_generate(target, prompt, N, eos_id, tok.pad_token_id)
        res = greedy(env, prompt, eos={eos_id})
        assert res.output_ids == ref
        assert res.accept_lengths == [1] * (len(ref) - 1)
        assert res.num_target_forwards == len(ref)
        assert res.tpot_s > 0
        # a drafter with block_size 1 is plain decoding too
        again = spec(env, make_drafter(target, tok, 4), prompt, 1, eos={eos_id})
        assert again.output_ids == ref and again.num_drafter_forwards == 0


def test_block_size_1_stops_at_eos_like_hf_generate(env):
    target, tok, _, _, prompts = env
    hit = 0
    for prompt in prompts:
        free = greedy(env, prompt, eos=set()).output_ids
        assert len(free) == N  # no eos: exactly max_new_tokens
        eos_id = free[5]  # a token the model does produce: make it the eos
        ref = hf_generate(target, prompt, N, eos_id, tok.pad_token_id)
        res = greedy(env, prompt, eos={eos_id})
        assert res.output_ids == ref
        assert res.output_ids[-1] == eos_id and res.stopped_on_eos and eos_id not in res.output_ids[:-1]
        hit += 1
    assert hit == len(prompts)


# ------------------------------------------------------------------------------ speculative


@pytest.mark.parametrize("block_size", [4, 8])
def test_random_drafter_is_lossless(env, block_size):
    target, tok, _, _, prompts = env
    drafter = make_drafter(target, tok, block_size, seed=block_size)
    for prompt in prompts:
        base = greedy(env, prompt)
        res = spec(env, drafter, prompt, block_size)
        assert res.output_ids == base.output_ids
        assert len(res.output_ids) == N
        check_bookkeeping(res, block_size, N)
        assert res.num_drafter_forwards == res.num_steps
        # with an eos inside the output: same cut as plain decoding
        eos_id = base.output_ids[N // 2]
        res_eos = spec(env, drafter, prompt, block_size, eos={eos_id})
        assert res_eos.output_ids == greedy(env, prompt, eos={eos_id}).output_ids
        assert res_eos.stopped_on_eos and res_eos.output_ids[-1] == eos_id
        check_bookkeeping(res_eos, block_size, N)


def _constant_drafter(env, block_size, token):
    """A real drafter whose layers add nothing (o_proj = down_proj = 0), so every MASK slot's final
    hidden state is u = norm(embed[MASK]); with a head whose only non-zero row is ``token`` = u, every
    draft is ``token``. It is accepted exactly while the target's greedy output repeats ``token``."""
    target, tok, embed, _, _ = env
    drafter = make_drafter(target, tok, block_size)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        u = drafter.norm(embed[drafter.arch.mask_token_id].float())
    head = torch.zeros_like(embed)
    head[token] = u
    return drafter, head


@pytest.mark.parametrize("block_size", [4, 8])
def test_accepting_drafter_is_lossless_and_counts_steps(repeating_env, block_size):
    """Runs of a repeated token in the target's greedy output give k = 0, middle and all B-1."""
    env = repeating_env
    target, tok, _, _, prompts = env
    n = 40
    hist = Counter()
    for prompt in prompts:
        base = greedy(env, prompt, n=n).output_ids
        token = Counter(base).most_common(1)[0][0]
        drafter, head = _constant_drafter(env, block_size, token)
        traces: list[StepTrace] = []
        res = spec(env, drafter, prompt, block_size, n=n, head=head, on_step=traces.append)
        assert res.output_ids == base
        check_bookkeeping(res, block_size, n)
        for tr in traces:
            assert tr.block[1:] == [token] * (block_size - 1)
            # k = the run of `token` the target predicts from slot 0 on
            run = next((j for j, y in enumerate(tr.predictions[:-1]) if y != token), block_size - 1)
            assert tr.accepted == run
        hist.update(res.accept_lengths)
        assert res.num_steps < len(res.output_ids) - 1 or res.tau == 1.0
    assert hist[1] > 0 and hist[block_size] > 0, hist
    assert any(hist[k] for k in range(2, block_size)), hist


def test_cache_lengths_after_each_step(env):
    target, tok, _, _, prompts = env
    B = 4
    prompt = prompts[1]
    base = greedy(env, prompt, n=40).output_ids
    drafter, head = _constant_drafter(env, B, Counter(base).most_common(1)[0][0])
    traces: list[StepTrace] = []
    res = spec(env, drafter, prompt, B, n=40, head=head, on_step=traces.append)
    P = len(prompt)
    assert traces[0].anchor == P and traces[0].context_fed == P
    rejected = 0
    for prev, tr in zip([None] + traces[:-1], traces, strict=True):
        # the drafter cache holds exactly the positions before the anchor (context rows only)
        assert tr.drafter_cache_len == tr.anchor
        if prev is not None:
            assert tr.anchor == prev.anchor + prev.accepted + 1
            assert tr.context_fed == prev.accepted + 1
        # the target cache is cropped to the accepted length: rejected drafts leave no trace
        assert tr.target_cache_len == tr.anchor + tr.accepted + 1
        rejected += tr.accepted < B - 1
    assert rejected > 0
    assert sum(t.accepted + 1 for t in traces) == sum(res.accept_lengths)


def test_drafts_equal_an_uncached_reference(env):
    """At every step, the cached drafter's drafts == a from-scratch drafter pass over the full context
    (target hidden states of positions 0..t-1 recomputed without any cache)."""
    target, tok, embed, head, prompts = env
    B = 4
    drafter = make_drafter(target, tok, B, seed=3, num_layers=2)
    prompt = prompts[0]
    traces: list[StepTrace] = []
    res = spec(env, drafter, prompt, B, n=16, on_step=traces.append)
    seq = prompt + res.output_ids
    with torch.inference_mode():
        for tr in traces:
            t = tr.anchor
            assert seq[t] == tr.block[0]
            out = target(input_ids=torch.tensor([seq[:t]]), output_hidden_states=True)
            ctx = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
            noise = embed[torch.tensor([[seq[t]] + [drafter.arch.mask_token_id] * (B - 1)])]
            hidden = drafter(
                noise, ctx, torch.arange(t).unsqueeze(0), torch.arange(t, t + B).unsqueeze(0), None
            )
            logits = hidden[0, 1:] @ head.T
            chosen = logits.gather(1, torch.tensor(tr.block[1:]).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(chosen, logits.max(-1).values, atol=1e-4, rtol=0)


def test_max_new_tokens_one_and_bad_arguments(env):
    target, tok, _, _, prompts = env
    drafter = make_drafter(target, tok, 4)
    res = spec(env, drafter, prompts[0], 4, n=1)
    assert len(res.output_ids) == 1 and res.num_steps == 0 and res.num_target_forwards == 1
    assert res.output_ids == greedy(env, prompts[0], n=1).output_ids
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec(env, drafter, prompts[0], 4, n=0)
    with pytest.raises(ValueError, match="layer_ids"):
        speculative_generate(
            target,
            drafter,
            env[2],
            env[3],
            prompts[0],
            max_new_tokens=4,
            eos_token_ids=set(),
            layer_ids=[1, 2, 3],
            block_size=4,
        )


def test_should_end_cuts_a_generation_after_the_current_step(env):
    """The periodic eval's deadline: the generation ends after the step in progress, its output the
    greedy prefix so far, its steps counted (``cut_short``); never before the first step."""
    target, tok, embed, thead, prompts = env
    drafter = make_drafter(target, tok, 4)
    whole = spec(env, drafter, prompts[0], 4, n=40)
    calls = []
    cut = speculative_generate(
        target,
        drafter,
        embed,
        thead,
        prompts[0],
        max_new_tokens=40,
        eos_token_ids=set(),
        layer_ids=LAYER_IDS,
        block_size=4,
        should_end=lambda: calls.append(1) or len(calls) >= 3,
    )
    assert cut.cut_short and not whole.cut_short and cut.num_steps == 3
    assert cut.output_ids == whole.output_ids[: len(cut.output_ids)] and len(cut.output_ids) < 40
    assert cut.accept_lengths == whole.accept_lengths[:3]


# ------------------------------------------------------------------------------ hybrid target


@pytest.mark.parametrize("block_size", [4, 8])
def test_hybrid_target_is_lossless_and_reports_tau(hybrid, block_size):
    """A Qwen3.5 text target (linear + full attention): speculative output == greedy output with a
    random drafter (mostly rejections: every one needs a replay) and with an accepting drafter (whole
    blocks accepted: no replay), and tau is reported."""
    target, tok, _, _, prompts = hybrid
    eos_id = target.generation_config.eos_token_id
    ref = hf_generate(target, prompts[0], N, eos_id, tok.pad_token_id)
    assert greedy(hybrid, prompts[0], eos={eos_id}).output_ids == ref  # plain decoding == HF generate
    drafter = make_drafter(target, tok, block_size, seed=block_size, num_layers=2)
    replays = 0
    for prompt in prompts:
        base = greedy(hybrid, prompt)
        res = spec(hybrid, drafter, prompt, block_size)
        assert res.output_ids == base.output_ids
        check_bookkeeping(res, block_size, N)
        replays += res.num_replay_forwards
        assert res.num_replay_forwards == sum(a < block_size for a in res.accept_lengths)
        assert res.tau == pytest.approx(sum(res.accept_lengths) / res.num_steps)
        token = Counter(base.output_ids).most_common(1)[0][0]
        const, head = _constant_drafter(hybrid, block_size, token)
        accepting = spec(hybrid, const, prompt, block_size, head=head)
        assert accepting.output_ids == base.output_ids
        check_bookkeeping(accepting, block_size, N)
    assert replays > 0
