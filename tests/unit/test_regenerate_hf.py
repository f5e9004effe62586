"""backend=hf: the same regeneration without a server (batched HF generate), equal to the target's
greedy continuation; its peak memory stays flat as max_tokens grows, unlike a generation that keeps
the scores of every step; a stop signal ends it at the next token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from openai_stub import wait_for
from testpaths import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.config import EXIT_STOPPED
from dflash.data.chat import CUT_AT_MAX_TOKENS, generation_prompt_ids
from dflash.data.regenerate.app import run
from dflash.data.regenerate.config import RegenerateConfig
from dflash.data.regenerate.hf_backend import eos_ids

MAX_TOKENS = 20


@pytest.mark.slow
def test_hf_backend_regenerates_turn_by_turn_as_greedy_generate(tiny_target_dir, tmp_path, one_thread):
    records = [
        {
            "messages": [
                {"role": "user", "content": "Continue this code:\nfrom __future__ import annotations"}
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "What comes next in _compat_pickle.py?\nIMPORT_MAPPING = {"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "Continue it."},
                {"role": "assistant", "content": "old"},
            ]
        },
        {"messages": [{"role": "system", "content": "only"}]},  # nothing to generate: malformed
        {"messages": [{"role": "user", "content": "Continue this code:\ndef _aix_tag(vrtl, bd):"}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = RegenerateConfig(
        input=str(tmp_path / "in.jsonl"),
        output=str(tmp_path / "out.jsonl"),
        backend="hf",
        model=str(tiny_target_dir),
        max_tokens=MAX_TOKENS,
        batch_size=2,
        device="cpu",
        progress_bar=False,
    )
    summary = run(cfg)
    assert (summary.written, summary.failed, summary.skipped) == (3, {"malformed": 1}, 0)
    assert summary.requests == 4 and summary.generated_tokens > 0
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    out = {r["source_index"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for idx, rec in out.items():
        kept = [m for m in records[idx]["messages"] if m["role"] != "assistant"]
        conv: list[dict] = []
        for got in rec["messages"]:
            if got["role"] == "assistant":
                ids = torch.tensor([generation_prompt_ids(tok, conv)])
                with torch.inference_mode():
                    gen = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids.shape[1] :]
                want = {"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)}
                if len(gen) == MAX_TOKENS and int(gen[-1]) not in eos_ids(tok, model):
                    want[CUT_AT_MAX_TOKENS] = True  # cut at max_tokens: marked
                assert got == want, idx
            else:
                assert got == kept.pop(0)
            conv.append(got)
        assert not kept
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"]  # a final user turn is answered
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["backend"] == "hf"


MEMORY = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from dflash.data.regenerate.hf_backend import generate

def hwm_mib():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024

def rss_mib():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

torch.manual_seed(0)
torch.set_num_threads(1)
V, NEVER = 50_000, 50_000  # an eos id outside the vocabulary: never generated, every row runs max_new_tokens
cfg = AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                           tie_word_embeddings=False, eos_token_id=NEVER, pad_token_id=0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()

class Tok:
    eos_token_id, pad_token_id = NEVER, 0

prompts = [[(7 * b + k) % 1000 + 1 for k in range(8)] for b in range(8)]
out = {}
for label, steps in (("short", 16), ("long", 512)):
    Path("/proc/self/clear_refs").write_text("5")
    base = rss_mib()
    ids, stops = generate(model, Tok(), prompts, steps, batch_size=8)
    assert all(len(x) == steps for x in ids) and stops == [None] * 8
    out[label] = hwm_mib() - base
Path("/proc/self/clear_refs").write_text("5")
base = rss_mib()
with torch.inference_mode():
    kept = model.generate(torch.tensor(prompts), attention_mask=torch.ones(8, 8, dtype=torch.long), do_sample=False,
                          max_new_tokens=512, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
assert len(kept.scores) == 512
out["scores_kept"] = hwm_mib() - base
print(json.dumps(out))
"""


@pytest.mark.slow
def test_hf_generation_peak_memory_is_flat_in_max_tokens(tmp_path):
    """8 rows, vocabulary 50,000: scores for 512 steps would be 8 x 512 x 50,000 fp32 = 0.8 GB. The
    backend's peak grows by a few MiB from 16 to 512 new tokens (the KV cache of a 1-layer model);
    the same generation keeping its scores grows by the whole [batch, steps, vocab] tensor."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\npeak extra MiB: {peak}")
    assert peak["long"] - peak["short"] < 40
    assert peak["scores_kept"] > 600  # the control: what the test would see if scores were kept


def test_hf_backend_stops_on_sigterm_during_generate(tiny_target_dir, tmp_path, one_thread):
    """The tiny target ends the first prompt by itself (~80 tokens) but runs the others to
    max_tokens=1000 (far longer than a stop may take); a SIGTERM once the first record is written
    ends the run at the next token, with exit status 75 and the records in flight not attempted."""
    prompts = ["Continue this code:\nimport os", "q0", "q1"]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts)
    )
    out = tmp_path / "out.jsonl"
    signalled: list[float] = []

    def stop_after_first_record() -> None:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 1, timeout_s=120)
        signalled.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGTERM)

    cfg = RegenerateConfig(
        input=str(tmp_path / "in.jsonl"),
        output=str(out),
        backend="hf",
        model=str(tiny_target_dir),
        max_tokens=1000,
        batch_size=1,
        device="cpu",
        progress_bar=False,
    )
    thread = threading.Thread(target=stop_after_first_record)
    thread.start()
    summary = run(cfg)
    took = time.perf_counter() - signalled[0]
    thread.join()
    print(f"\nstopped {took:.2f} s after SIGTERM")
    assert summary.signal == "SIGTERM" and summary.exit_code == EXIT_STOPPED
    assert summary.written == 1 and summary.not_attempted == 2 and took < 5
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["status"] == "stopped"
