"""Target side: config-only meta, loading, headless forward with hooks, batch layouts, embed/head by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from testpaths import REPO

from dflash.config import TargetConfig
from dflash.targets.forward import build_batch, gather_tokens, target_forward
from dflash.targets.hooks import capture_hidden_states
from dflash.targets.loader import (
    base_model,
    check_remote_code,
    decoder_layers,
    default_layer_ids,
    load_embed_and_head,
    load_target,
    read_target_meta,
    resolve_layer_ids,
)

SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def make_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**SMALL, "tie_word_embeddings": False, **overrides}
    if model_type == "qwen3_5_text":
        kw.update(
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
        )
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # Random-init norms are all ones: perturb them so "post-norm" vs "pre-norm" mistakes show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def tcfg(path, **kw) -> TargetConfig:
    return TargetConfig(name="t", path=str(path), dtype="float32", **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written with save_pretrained: untied, tied, sharded, and a Qwen3.5 VLM wrapper."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    root = tmp_path_factory.mktemp("targets")
    out = {}
    for name, kw, save_kw in (
        ("untied", {}, {}),
        ("tied", {"tie_word_embeddings": True}, {}),
        ("sharded", {}, {"max_shard_size": "100KB"}),
    ):
        make_model(**kw).save_pretrained(root / name, **save_kw)
        out[name] = root / name
    text = {**SMALL, "num_hidden_layers": 4, "tie_word_embeddings": False}
    text.update(
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    )
    vlm.save_pretrained(root / "qwen3_5_vlm")
    out["qwen3_5_vlm"] = root / "qwen3_5_vlm"
    return out


@pytest.fixture(scope="module")
def qwen3():
    return make_model("qwen3")


def rand_seqs(lengths, vocab=SMALL["vocab_size"], seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


# ----------------------------------------------------------------------------------------------
# layer ids, config checks, meta


def test_default_layer_ids_public_convention():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_layer_ids(36, 1) == [18]


def test_resolve_layer_ids(saved):
    meta = read_target_meta(str(saved["untied"]))
    assert resolve_layer_ids(tcfg(saved["untied"], num_taps=2), meta) == [1, 3]
    assert resolve_layer_ids(tcfg(saved["untied"], layer_ids=[0, 5]), meta) == [0, 5]
    with pytest.raises(ValueError, match=r"target\.layer_ids=\[1, 6\].*outside"):
        resolve_layer_ids(tcfg(saved["untied"], layer_ids=[1, 6]), meta)
    with pytest.raises(ValueError, match=r"target\.layer_ids=\[2, 2\].*listed more than once"):
        resolve_layer_ids(tcfg(saved["untied"], layer_ids=[2, 2]), meta)
    with pytest.raises(ValueError, match=r"target\.num_taps=5"):  # 6 layers: round() gives duplicates
        resolve_layer_ids(tcfg(saved["untied"], num_taps=5), meta)


def test_check_remote_code():
    check_remote_code(tcfg("x"))
    check_remote_code(tcfg("x", trust_remote_code=True, revision="a" * 40))
    for rev in (None, "main", "abc123"):
        with pytest.raises(ValueError, match=r"target\.revision"):
            check_remote_code(tcfg("x", trust_remote_code=True, revision=rev))


def test_read_target_meta(saved):
    meta = read_target_meta(str(saved["untied"]))
    assert (meta.model_type, meta.num_layers, meta.hidden_size, meta.vocab_size) == ("qwen3", 6, 64, 384)
    assert (meta.num_heads, meta.num_kv_heads, meta.head_dim, meta.intermediate_size) == (4, 2, 16, 128)
    assert meta.tie_word_embeddings is False and meta.max_position_embeddings == 512
    assert meta.text_config["rope_parameters"]["rope_theta"] > 0
    assert not meta.is_hybrid_linear_attention
    assert read_target_meta(str(saved["tied"])).tie_word_embeddings is True
    vlm = read_target_meta(str(saved["qwen3_5_vlm"]))  # the text config of the VLM wrapper
    assert (vlm.model_type, vlm.num_layers, vlm.hidden_size, vlm.vocab_size) == ("qwen3_5_text", 4, 64, 384)
    assert (
        vlm.text_config["rope_parameters"]["partial_rotary_factor"] == 0.25 and vlm.is_hybrid_linear_attention
    )


def test_load_target_frozen(saved):
    model = load_target(tcfg(saved["tied"]), torch.device("cpu"), torch.float32)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(decoder_layers(model)) == 6 and not hasattr(base_model(model), "lm_head")
    vlm = load_target(tcfg(saved["qwen3_5_vlm"]), torch.device("cpu"), torch.float32)
    assert type(vlm).__name__ == "Qwen3_5ForCausalLM" and len(decoder_layers(vlm)) == 4


# ----------------------------------------------------------------------------------------------
# headless forward and hooks


def test_lm_head_never_runs(qwen3):
    calls = []
    handle = qwen3.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        ids = rand_seqs([24])[0][None]
        target_forward(qwen3, ids, None, [1, 3])
        assert calls == []
        with torch.no_grad():
            qwen3(input_ids=ids, use_cache=False)  # the hook does count a plain model(...) call
        assert calls == [1]
    finally:
        handle.remove()


def test_hooks_removed_also_on_exception(qwen3):
    layers = decoder_layers(qwen3)
    ids = rand_seqs([10])[0][None]
    with capture_hidden_states(qwen3, [1, 4]) as captured:
        assert len(layers[1]._forward_hooks) == 1 and len(layers[4]._forward_hooks) == 1
        with torch.no_grad():
            base_model(qwen3)(input_ids=ids, use_cache=False)
    assert set(captured) == {1, 4} and captured[1].shape == (1, 10, 64)
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    with pytest.raises(RuntimeError, match="boom"):
        with capture_hidden_states(qwen3, [0, 2]):
            raise RuntimeError("boom")
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    target_forward(qwen3, ids, None, [2])
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    with pytest.raises(ValueError, match="outside"):
        target_forward(qwen3, ids, None, [9])
    assert all(len(layer._forward_hooks) == 0 for layer in layers)


def test_taps_equal_output_hidden_states(qwen3):
    layer_ids = [0, 1, 3, 4]
    ids = torch.stack(rand_seqs([20, 20], seed=3))
    aux, final = target_forward(qwen3, ids, None, layer_ids)
    with torch.no_grad():
        ref = qwen3(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert aux.shape == (2, 20, len(layer_ids) * 64) and final.shape == (2, 20, 64)
    for i, layer in enumerate(layer_ids):
        torch.testing.assert_close(
            aux[..., i * 64 : (i + 1) * 64], ref.hidden_states[layer + 1], rtol=0, atol=0
        )
    torch.testing.assert_close(final, ref.hidden_states[-1], rtol=0, atol=0)  # post final norm
    torch.testing.assert_close(qwen3.lm_head(final), ref.logits, rtol=1e-5, atol=1e-5)


def _alone(model, seqs, layer_ids):
    outs = [target_forward(model, s[None], None, layer_ids) for s in seqs]
    return torch.cat([a[0] for a, _ in outs]), torch.cat([f[0] for _, f in outs])


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_packed_equals_each_sequence_alone(model_type, qwen3):
    model = qwen3 if model_type == "qwen3" else make_model("llama")
    seqs = rand_seqs([17, 5, 30, 1], seed=1)
    ids, mask, pos, keep = build_batch(seqs, pack=True, pad_id=0)
    assert ids.shape == (1, 53) and mask is None and pos[0, 17:22].tolist() == [0, 1, 2, 3, 4]
    aux, final = target_forward(model, ids, mask, [1, 4], position_ids=pos)
    ref_aux, ref_final = _alone(model, seqs, [1, 4])
    torch.testing.assert_close(gather_tokens(aux, keep), ref_aux, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gather_tokens(final, keep), ref_final, rtol=1e-4, atol=1e-4)
    # without restarting position ids the documents would see each other: the check has teeth
    leak, _ = target_forward(model, ids, None, [1, 4])
    assert not torch.allclose(leak[0, 17:22], ref_aux[17:22], atol=1e-3)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_padded_equals_each_sequence_alone(model_type, qwen3):
    model = qwen3 if model_type == "qwen3" else make_model("qwen3_5_text", num_hidden_layers=4)
    seqs = rand_seqs([9, 21, 4], seed=2)
    ids, mask, pos, keep = build_batch(seqs, pack=False, pad_id=7)
    assert ids.shape == (3, 21) and mask.sum().item() == 34 and (ids[2, 4:] == 7).all()
    aux, final = target_forward(model, ids, mask, [1, 2], position_ids=pos)
    ref_aux, ref_final = _alone(model, seqs, [1, 2])
    assert keep.shape == (34,)
    torch.testing.assert_close(gather_tokens(aux, keep), ref_aux, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gather_tokens(final, keep), ref_final, rtol=1e-4, atol=1e-4)
    assert torch.equal(gather_tokens(ids, keep), torch.cat(seqs))


def test_build_batch_rejects_empty():
    with pytest.raises(ValueError):
        build_batch([], pack=True, pad_id=0)
    with pytest.raises(ValueError):
        build_batch([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], pack=False, pad_id=0)


# ----------------------------------------------------------------------------------------------
# embedding and lm_head by name


@pytest.mark.parametrize("kind", ["untied", "tied", "sharded", "qwen3_5_vlm"])
def test_load_embed_and_head_matches_model(saved, kind):
    from transformers import AutoModelForCausalLM

    if kind == "sharded":
        assert (saved[kind] / "model.safetensors.index.json").is_file()
    embed, head = load_embed_and_head(str(saved[kind]))
    model = AutoModelForCausalLM.from_pretrained(saved[kind], dtype=torch.float32)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.lm_head.weight)
    assert embed.shape == (384, 64)
    assert torch.equal(embed, head) == (kind == "tied")


def test_load_embed_and_head_from_hub_cache(saved, tmp_path, monkeypatch):
    """A hub id resolves through the huggingface_hub cache (offline here), shard by shard."""
    import shutil

    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny-target"
    shutil.copytree(saved["sharded"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    embed, head = load_embed_and_head("org/tiny-target")
    ref_embed, ref_head = load_embed_and_head(str(saved["sharded"]))
    assert torch.equal(embed, ref_embed) and torch.equal(head, ref_head)
    assert torch.equal(load_embed_and_head("org/tiny-target", revision=commit)[1], ref_head)


# ----------------------------------------------------------------------------------------------
# memory: the headless forward never materialises the logits

_MEM_SCRIPT = textwrap.dedent(
    """
    import json, re, sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from dflash.targets.forward import target_forward
    torch.set_num_threads(1)
    mode, vocab, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, vocab, (1, tokens))
    def call():
        if mode == "target_forward":
            return target_forward(model, ids, None, [0, 1])
        with torch.inference_mode():  # the plain way to get the same taps: every hidden state + logits
            return model(input_ids=ids, use_cache=False, output_hidden_states=True)
    def kib(key):
        return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    out = call(); del out  # warm-up: lazy init, allocator arenas
    deltas = []
    for _ in range(3):  # the least peak growth of 3 calls: allocator noise only ever adds
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
        rss0 = kib("VmRSS")
        out = call()
        deltas.append((kib("VmHWM") - rss0) * 1024)
        del out
    print(json.dumps({"delta_bytes": min(deltas), "deltas": deltas}))
    """
)


def _peak_deltas(modes: list[str], vocab: int, tokens: int) -> dict[str, int]:
    """Peak RSS growth of one call per mode, each in its own fresh interpreter (run side by side)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-c", _MEM_SCRIPT, m, str(vocab), str(tokens)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for m in modes
    }
    out = {}
    try:
        for m, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            out[m] = json.loads(stdout.strip().splitlines()[-1])["delta_bytes"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_target_forward_peak_memory_skips_logits():
    vocab, tokens = 32768, 1024
    logits_bytes = vocab * tokens * 4  # 128 MiB of fp32 logits that model(...) builds
    deltas = _peak_deltas(["target_forward", "model"], vocab, tokens)
    headless, full = deltas["target_forward"], deltas["model"]
    # model(...) grows memory by at least its logits; the headless forward by less than an eighth of
    # them. (Not full - headless >= logits: model(...)'s other tensors may reuse freed allocator memory.)
    assert full >= logits_bytes and 8 * headless < logits_bytes, (full, headless, logits_bytes)


@pytest.mark.parametrize("kind", ["untied", "sharded"])
def test_weights_fingerprint_changes_with_the_weights_at_the_same_path(saved, tmp_path, kind):
    """Issue 19 item 7: every weight scaled by 1.5 under the same target.path is another target
    (the run contract holds this fingerprint, so a resume is refused); a copy is the same target."""
    import shutil

    from transformers import AutoModelForCausalLM

    from dflash.targets.info import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(saved[kind], copy)
    before = weights_fingerprint(str(copy))
    assert before == weights_fingerprint(str(saved[kind])) and len(before) == 64
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(copy, **({"max_shard_size": "100KB"} if kind == "sharded" else {}))
    assert weights_fingerprint(str(copy)) != before
    (tmp_path / "empty").mkdir()
    assert weights_fingerprint(str(tmp_path / "empty")) == "none"
