"""The eval package end to end: evaluate() + report on the tiny target, the input errors of the app,
and ``python -m dflash.eval`` in a subprocess with offline W&B read back."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from ranks import run_module
from wandb_reader import read_wandb_run

from dflash.cli import compose_config
from dflash.drafter.arch import DrafterArch, rope_from_config
from dflash.drafter.export import export_drafter
from dflash.drafter.model import DFlashDraftModel
from dflash.eval.config import EvalAppConfig, register_eval_schema
from dflash.eval.loading import load_for_eval, load_prompts
from dflash.eval.results import build_report, evaluate, report_metrics, report_table

LAYER_IDS = [1, 2, 4]  # conf/target/tiny.yaml
QUESTIONS = ["def foo(x):", "import os", "class A:"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _arch(target_dir: Path, **kw) -> DrafterArch:
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(target_dir)
    rope, partial = rope_from_config(c.to_dict())
    base = dict(
        hidden_size=c.hidden_size,
        intermediate_size=256,
        num_layers=1,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=len(AutoTokenizer.from_pretrained(target_dir)),
        rope_parameters=rope,
        partial_rotary_factor=partial,
    )
    base.update(kw)
    return DrafterArch(**base)


def _export(target_dir: Path, out: Path, **kw) -> Path:
    model = DFlashDraftModel(_arch(target_dir, **kw))
    model.reset_parameters(seed=0)
    return export_drafter(model, out, target_num_layers=6)


@pytest.fixture(scope="module")
def files(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_app")
    drafter = _export(tiny_target_dir, root / "drafter")
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for q in QUESTIONS:
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}
                )
                + "\n"
            )
        f.write("not json\n")  # skipped with a warning
        f.write(json.dumps({"messages": [{"role": "user", "content": "no answer yet"}]}) + "\n")
    return root, drafter, prompts


def _compose(overrides: list[str]) -> EvalAppConfig:
    from omegaconf import OmegaConf

    register_eval_schema()
    return OmegaConf.to_object(compose_config("eval_app", overrides))


def _overrides(target_dir, drafter, prompts, *extra) -> list[str]:
    return [
        f"target.path={target_dir}",
        "target.tiny=null",
        f"drafter_path={drafter}",
        f"prompts={prompts}",
        "max_new_tokens=12",
        "warmup=false",
        *extra,
    ]


# ------------------------------------------------------------------------------ report


def test_build_report_on_hand_made_results():
    from dflash.eval.results import PromptResult

    a = PromptResult(0, 5, [1, 2, 3, 4, 5], [1, 3, 1], 0.01, 4, [1, 2, 3, 4, 5], 0.02)
    b = PromptResult(1, 7, [7, 8, 9], [2, 4], 0.02, 3, [7, 8, 0], 0.06)
    rep = build_report([a, b], block_size=4, max_new_tokens=5)
    assert rep.tau == pytest.approx((1 + 3 + 1 + 2 + 4) / 5)  # over all steps, not a mean of means
    assert a.tau == pytest.approx(5 / 3) and b.tau == pytest.approx(3.0)
    assert rep.accept_len_hist == {1: 2, 2: 1, 3: 1, 4: 1}
    assert rep.tpot_s == pytest.approx(0.015) and rep.tpot_ar_s == pytest.approx(0.04)
    assert rep.speedup == pytest.approx(0.04 / 0.015)
    assert rep.lossless is False and len(rep.mismatches) == 1 and "prompt 1" in rep.mismatches[0]
    assert "at new token 2" in rep.mismatches[0]
    m = report_metrics(rep)
    assert m["eval/tau"] == pytest.approx(2.2) and m["eval/lossless"] == 0.0
    assert m["eval/tpot_ms"] == pytest.approx(15.0) and m["eval/tpot_ar_ms"] == pytest.approx(40.0)
    assert [m[f"eval/accept_len_hist/{k}"] for k in range(1, 5)] == [2.0, 1.0, 1.0, 1.0]
    table = report_table(rep)
    assert "lossless: NO" in table and "tau = 2.200" in table and "2.67x" in table
    no_base = build_report([PromptResult(0, 5, [1, 2], [2], 0.01, 2)], block_size=4, max_new_tokens=2)
    assert no_base.lossless is None and no_base.speedup is None
    assert "eval/speedup" not in report_metrics(no_base) and "not checked" in report_table(no_base)


def test_evaluate_on_the_tiny_target(files, tiny_target_dir):
    root, drafter_dir, prompts_path = files
    setup = load_for_eval(_compose(_overrides(tiny_target_dir, drafter_dir, prompts_path)))
    assert len(setup.prompts) == 4  # 3 + the one without an assistant answer; the bad line skipped
    assert setup.layer_ids == LAYER_IDS and setup.block_size == 4
    assert setup.eos_ids == {setup.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    from dflash.targets.loader import load_embed_and_head

    embed, head = load_embed_and_head(str(tiny_target_dir))  # what the drafter was trained with
    assert torch.equal(setup.embed, embed) and torch.equal(setup.head, head)
    rep = evaluate(
        setup.target,
        setup.drafter,
        setup.embed,
        setup.head,
        setup.tokenizer,
        setup.prompts,
        max_new_tokens=12,
        layer_ids=setup.layer_ids,
        block_size=4,
        eos_ids=setup.eos_ids,
        warmup=True,
    )
    assert rep.lossless is True and rep.mismatches == []
    assert sum(rep.accept_len_hist.values()) == rep.num_steps > 0
    assert set(rep.accept_len_hist) == {1, 2, 3, 4}
    steps = [a for r in rep.results for a in r.accept_lengths]
    assert rep.tau == pytest.approx(sum(steps) / len(steps)) and rep.tau >= 1
    assert math.isfinite(rep.speedup) and rep.speedup > 0
    m = report_metrics(rep)
    assert {
        "eval/tau",
        "eval/speedup",
        "eval/tpot_ms",
        "eval/tpot_ar_ms",
        "eval/lossless",
        "eval/accept_len_hist/1",
        "eval/accept_len_hist/4",
    } <= set(m)
    assert "lossless: yes" in report_table(rep)
    # without a drafter: plain decoding, tau exactly 1
    ar = evaluate(
        setup.target,
        None,
        None,
        None,
        None,
        setup.prompts[:1],
        max_new_tokens=6,
        layer_ids=LAYER_IDS,
        block_size=4,
        eos_ids=setup.eos_ids,
        baseline=False,
        warmup=False,
    )
    assert ar.tau == 1.0 and ar.block_size == 1 and ar.lossless is None


def test_prompts_are_the_chat_template_prompt(files, tiny_target_dir):
    from transformers import AutoTokenizer

    _, _, prompts_path = files
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = load_prompts(str(prompts_path), tok, num_prompts=2)
    assert len(ids) == 2
    assert tok.decode(ids[0]) == "<|im_start|>user\ndef foo(x):<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="prompts="):
        load_prompts(str(prompts_path.with_name("missing.jsonl")), tok)


def test_prompts_from_a_datasets_directory(tmp_path, tiny_target_dir):
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}
        for q in QUESTIONS
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts(str(tmp_path / "ds"), tok) == load_prompts(str(jsonl), tok)


def test_eval_and_periodic_eval_on_a_hybrid_target(files, tiny_hybrid_target_dir, tmp_path):
    """A Qwen3.5 text target (linear + full attention): ``dflash.eval``'s loading and evaluate, and the
    periodic eval of a training run, decode losslessly with a sliding-window drafter and report tau."""
    from dflash.config import register_configs, to_config
    from dflash.targets.loader import load_embed_and_head
    from dflash.train.periodic_eval import PeriodicEval, eval_metrics
    from dflash.train.setup import prepare

    _, _, prompts_path = files
    layout = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8, num_layers=2)
    drafter_dir = _export(tiny_hybrid_target_dir, tmp_path / "drafter", **layout)
    setup = load_for_eval(_compose(_overrides(tiny_hybrid_target_dir, drafter_dir, prompts_path)))
    assert setup.drafter.arch.layer_types == layout["layer_types"]
    rep = evaluate(
        setup.target,
        setup.drafter,
        setup.embed,
        setup.head,
        setup.tokenizer,
        setup.prompts[:2],
        max_new_tokens=12,
        layer_ids=setup.layer_ids,
        block_size=4,
        eos_ids=setup.eos_ids,
        warmup=False,
    )
    assert rep.lossless is True and rep.num_steps > 0 and rep.tau >= 1

    conversations = tmp_path / "chat.jsonl"
    with open(conversations, "w") as f:
        for q in QUESTIONS * 2:
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": f"{q} pass"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    register_configs()
    overrides = [
        f"target.path={tiny_hybrid_target_dir}",
        "target.tiny=null",
        "target.pack=false",
        f"data.path={conversations}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "data.num_eval_prompts=2",
        "data.max_length=64",
        "data.token_budget=256",
        "drafter.layer_types=[sliding_attention,full_attention]",
        "drafter.sliding_window=8",
        "eval.every=1",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
    ]
    cfg = to_config(compose_config("config", overrides))
    run = prepare(cfg, 3)
    drafter = DFlashDraftModel(run.arch)
    embed, head = load_embed_and_head(run.target_path)
    sums = PeriodicEval(cfg, run, torch.device("cpu")).run(drafter, embed, head)
    metrics = eval_metrics(sums, run.arch.block_size)
    assert metrics["eval/tau"] >= 1 and math.isfinite(metrics["eval/tau_hat"])


# ------------------------------------------------------------------------------ errors


def test_missing_drafter_dir_names_the_field(files, tiny_target_dir):
    root, _, prompts = files
    with pytest.raises(ValueError, match="drafter_path=.*set drafter_path="):
        load_for_eval(_compose(_overrides(tiny_target_dir, root / "nope", prompts)))
    (root / "empty").mkdir(exist_ok=True)
    with pytest.raises(ValueError, match="lacks.*config.json"):
        load_for_eval(_compose(_overrides(tiny_target_dir, root / "empty", prompts)))


def test_mismatched_drafter_is_refused(files, tiny_target_dir):
    root, _, prompts = files
    wide = _export(tiny_target_dir, root / "wide", hidden_size=64, head_dim=16)
    with pytest.raises(ValueError, match="hidden_size=64 differs from target.*hidden_size=128"):
        load_for_eval(_compose(_overrides(tiny_target_dir, wide, prompts)))
    other_taps = _export(tiny_target_dir, root / "taps", target_layer_ids=[1, 3, 5])
    with pytest.raises(
        ValueError, match=r"target.layer_ids=\[1, 2, 4\] but the drafter was trained on taps \[1, 3, 5\]"
    ):
        load_for_eval(_compose(_overrides(tiny_target_dir, other_taps, prompts)))
    # with target.layer_ids=null the drafter's taps are used
    setup = load_for_eval(_compose(_overrides(tiny_target_dir, other_taps, prompts, "target.layer_ids=null")))
    assert setup.layer_ids == [1, 3, 5]
    deep = _export(tiny_target_dir, root / "deep", target_layer_ids=[1, 2, 7])
    with pytest.raises(
        ValueError, match=r"target_layer_ids=\[1, 2, 7\]: layers \[7\] outside the target's 6"
    ):
        load_for_eval(_compose(_overrides(tiny_target_dir, deep, prompts, "target.layer_ids=null")))


def test_bad_eval_settings_are_reported_together(files, tiny_target_dir):
    _, drafter, prompts = files
    with pytest.raises(ValueError, match="2 eval config problem") as e:
        load_for_eval(
            _compose(_overrides(tiny_target_dir, drafter, prompts, "max_new_tokens=0", "block_size=0"))
        )
    assert "max_new_tokens=0" in str(e.value) and "block_size=0" in str(e.value)


# ------------------------------------------------------------------------------ the app


def test_app_subprocess_logs_tau_to_offline_wandb(files, tiny_target_dir, tmp_path):
    _, drafter, prompts = files
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    argv = [
        *_overrides(tiny_target_dir, drafter, prompts),
        "num_prompts=2",
        "logging.mode=offline",
        "logging.project=dflash-test",
        "step=7",
        f"hydra.run.dir={run_dir}",
    ]
    # python -m dflash.eval, in a process forked from tests/ranks.py's forkserver
    proc = run_module("dflash.eval", argv, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DFlash eval: 2 prompts, block size 4" in proc.stdout and "lossless: yes" in proc.stdout
    assert f"report: {run_dir / 'report.json'}" in proc.stdout  # says where the report went
    assert (run_dir / "eval.log").is_file() and not (run_dir / "__main__.log").exists()
    report = json.loads((run_dir / "report.json").read_text())
    run = read_wandb_run(run_dir)
    (row,) = run.history
    assert row["train/step"] == 7
    assert row["eval/tau"] == pytest.approx(report["tau"])
    assert row["eval/lossless"] == 1.0 and row["eval/speedup"] > 0
    assert sum(row[f"eval/accept_len_hist/{k}"] for k in range(1, 5)) == report["num_steps"]
    # the wandb.Histogram (the reader flattens its JSON into .../_type, /values, /bins)
    assert row["eval/accept_len_histogram/_type"] == "histogram"
    assert row["eval/accept_len_histogram/values"] == [row[f"eval/accept_len_hist/{k}"] for k in range(1, 5)]
    assert run.summary["eval/tau"] == pytest.approx(report["tau"])
    assert run.config["drafter_path"] == str(drafter)


# ------------------------------------------------------------------------------ hostile inputs (issue 19)


def _hostile_drafter(drafter: Path, out: Path, **config) -> Path:
    import shutil

    shutil.copytree(drafter, out)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps({**raw, **config}))
    return out


@pytest.mark.parametrize(
    "config", [{"intermediate_size": 10**9}, {"num_hidden_layers": 10**5, "intermediate_size": 10**5}]
)
def test_a_hostile_drafter_shape_is_refused_before_anything_is_built(
    files, tiny_target_dir, tmp_path, config
):
    """An FFN of 10^9 (1.5 TB) or 10^5 layers (15 TB) in the drafter's config.json: one error naming
    the file, the fields and the GiB, before the target or the drafter is built (was: minutes)."""
    import time

    _, drafter, prompts = files
    hostile = _hostile_drafter(drafter, tmp_path / "hostile", **config)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as err:
        load_for_eval(_compose(_overrides(tiny_target_dir, hostile, prompts)))
    assert time.perf_counter() - t0 < 10
    msg = str(err.value)
    assert f"drafter_path={hostile}/config.json: " in msg and "GiB of drafter weights" in msg
    assert all(f"{k}={v}" in msg for k, v in config.items())
    assert "host RAM" in msg and "nothing was allocated" in msg


def test_out_of_vocab_prompt_ids_are_refused_before_the_target_loads(files, tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    _, drafter, _ = files
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    prompts = tmp_path / "ids.jsonl"
    rows = [
        {"input_ids": [5, 6, vocab + 3, 7, 8], "loss_mask": [0, 0, 0, 1, 1]},
        {"input_ids": [5, 6, 9, 7, 8], "loss_mask": [0, 0, 0, 1, 1]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert load_prompts(str(prompts), tok, vocab_size=vocab) == [[5, 6, 9]]  # the bad one skipped, named
    prompts.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"no usable prompt .*check target.tokenizer"):  # was: IndexError
        load_for_eval(_compose(_overrides(tiny_target_dir, drafter, prompts)))


def test_a_tokenizer_without_chat_template_is_one_error_naming_target_tokenizer(
    files, tiny_target_dir, tmp_path
):
    import shutil

    from transformers import AutoTokenizer

    _, _, prompts = files
    bare = tmp_path / "bare_tokenizer"
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(bare)
    assert not tok.chat_template
    with pytest.raises(
        ValueError,
        match=rf"has no chat template, and prompts holds .*\(first: {prompts}:1\); set target.tokenizer=",
    ):
        load_prompts(str(prompts), tok)
    shutil.rmtree(bare)


@pytest.mark.parametrize("missing", ["prompts", "drafter_path"])
def test_the_app_reports_a_missing_file_in_one_line_with_exit_2(files, tiny_target_dir, tmp_path, missing):
    _, drafter, prompts = files
    paths = {"prompts": prompts, "drafter_path": drafter, missing: tmp_path / f"no_{missing}.jsonl"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    argv = [
        *_overrides(tiny_target_dir, paths["drafter_path"], paths["prompts"]),
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = run_module(
        "dflash.eval", argv, env=env, cwd=tmp_path, timeout=120
    )  # forked, as the app test above
    assert proc.returncode == 2, proc.stderr[-3000:]  # was 1, with a 20-line traceback
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dflash: error:")]
    assert len(errors) == 1 and f"{missing}=" in errors[0] and "Traceback" not in proc.stderr, proc.stderr


def _edited(src: Path, dst: Path, edit) -> Path:
    """A copy of the export ``src`` whose config.json ``edit(config)`` changed, as a user's hand would."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(section: str | None, key: str, value):
    def edit(cfg: dict) -> None:
        (cfg[section] if section else cfg)[key] = value

    return edit


@pytest.mark.parametrize(
    ("name", "edit", "needle"),
    [
        (
            "unsorted",
            _set("dflash_config", "target_layer_ids", [4, 1, 2]),
            "target_layer_ids=[4, 1, 2]: not in increasing order",
        ),
        (
            "dup",
            _set("dflash_config", "target_layer_ids", [1, 1, 4]),
            "target_layer_ids=[1, 1, 4]: layers [1] listed more than once",
        ),
        (
            "range",
            _set("dflash_config", "target_layer_ids", [1, 2, 9]),
            "target_layer_ids=[1, 2, 9]: layers [9] outside",
        ),
        (
            "eos",
            _set("dflash_config", "mask_token_id", 2),
            "dflash_config.mask_token_id=2 is the tokenizer's eos_token_id",
        ),
        (
            "text",
            _set("dflash_config", "mask_token_id", 5),
            "dflash_config.mask_token_id=5 is the text token '#'",
        ),
        (
            "block",
            _set(None, "block_size", 8),
            "block_size=8 (top level) and dflash_config.block_size=4 differ",
        ),
        (
            "interleaved",
            _set(None, "is_neox_style", False),
            "is_neox_style=false: the export says it was trained with its heads' RoPE rotated in interleaved pairs",
        ),
        (
            "softcap",
            _set("dflash_config", "final_logit_softcapping", 20.0),
            "dflash_config.final_logit_softcapping=20.0: the export's drafts go through the target head",
        ),
        (
            "anchor",
            _set("dflash_config", "sample_from_anchor", True),
            "dflash_config.sample_from_anchor=true: the export says it was trained with slot k predicting",
        ),
    ],
)
def test_an_export_edited_to_a_wrong_tap_order_mask_or_block_size_is_refused(
    files, tiny_target_dir, name, edit, needle
):
    """Each of these evaluated without a word (tau 1.458 -> 1.332 / 1.223 on the demo drafter for the
    eos and '#' masks; eval used the top-level block size): now one error naming the field."""
    root, drafter, prompts = files
    bad = _edited(drafter, root / f"edited_{name}", edit)
    with pytest.raises(ValueError) as err:
        load_for_eval(_compose(_overrides(tiny_target_dir, bad, prompts)))
    assert needle in str(err.value) and f"drafter_path={bad}" in str(err.value).replace("'", "")


def test_a_mask_the_exports_own_tokenizer_records_is_accepted(files, tiny_target_dir):
    """An export that ships a tokenizer recording its mask token may use a token the target's tokenizer
    calls text; a mask_token_id other than the recorded one is refused."""
    from transformers import AutoTokenizer

    root, drafter, prompts = files
    own = _edited(drafter, root / "own_tokenizer", _set("dflash_config", "mask_token_id", 5))
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.mask_token = "#"
    tok.save_pretrained(own)
    assert load_for_eval(_compose(_overrides(tiny_target_dir, own, prompts))).drafter.arch.mask_token_id == 5
    other = _edited(own, root / "own_tokenizer_other", _set("dflash_config", "mask_token_id", 2048))
    with pytest.raises(
        ValueError, match="mask_token_id=2048 is not 5, the mask token the export's own tokenizer"
    ):
        load_for_eval(_compose(_overrides(tiny_target_dir, other, prompts)))
