"""Hydra composition of every experiment, overrides, and config errors that name the field and the fix."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError
from testpaths import REPO

from dflash.cli import compose_config
from dflash.config import (
    RESOLVED_CONTRACT_KEYS,
    RESUME_KINDS,
    Config,
    DataConfig,
    UserError,
    contract_values,
    dataset_settings,
    register_configs,
    schema_leaves,
    to_config,
)
from dflash.config.checks import check_known_keys, validate
from dflash.config.modes import planned_world_size
from dflash.distributed.topology import Topology

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def _compose(overrides: list[str]) -> Config:
    register_configs()
    return to_config(compose_config("config", overrides))


def test_required_experiments_exist():
    assert {"tiny_cpu", "qwen3_8b_7x1", "qwen3_6_27b_7x1", "qwen3_8b_8gpu", "qwen3_6_27b_8gpu"} <= set(
        EXPERIMENTS
    )


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = _compose([f"experiment={experiment}", "data.path=/data/chat.jsonl"])
    assert cfg.name == experiment
    validate(cfg, planned_world_size(cfg.topology))


def test_default_is_the_embedded_cpu_run():
    cfg = _compose([])
    assert cfg.name == "tiny_cpu" and cfg.data.path == "embedded" and cfg.target.tiny is not None
    assert (cfg.topology.num_targets, cfg.topology.num_drafters, cfg.topology.backend) == (2, 1, "gloo")


def test_qwen3_6_27b_experiment_matches_the_published_drafter():
    cfg = _compose(["experiment=qwen3_6_27b_7x1", "data.path=/d.jsonl"])
    assert cfg.target.layer_ids == [1, 16, 31, 46, 61] and cfg.drafter.mask_token_id == 248070
    assert cfg.topology.num_targets == 7 and cfg.target.pack  # hybrids pack (dflash.targets.linear_attention)
    assert cfg.drafter.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg.drafter.sliding_window == 2048 and cfg.drafter.partial_rotary_factor == 1.0


def test_any_value_is_overridable():
    cfg = _compose(
        [
            "train.max_steps=100",
            "target=qwen3_8b",
            "topology.num_targets=7",
            "loss=ce_kl",
            "loss.temperature=2.0",
        ]
    )
    assert cfg.train.max_steps == 100 and cfg.target.name == "qwen3_8b" and cfg.topology.num_targets == 7
    assert cfg.loss.kl == 1.0 and cfg.loss.temperature == 2.0


def test_an_unknown_dotted_override_names_the_closest_key_not_plus():
    """Issue 19 item 12: ``train.max_step=10`` got Hydra's advice to add ``+train.max_step``."""
    from dflash.config import Config
    from dflash.config.checks import override_key_problems

    args = ["train.max_step=10", "topology=colocated", "data.chat_template_kwargs.enable_thinking=false"]
    args += ["+x.y=1", "hydra.run.dir=/tmp/r", "train.max_steps=5", "loss.ce=1", "drafter.nope.deep=2"]
    assert override_key_problems(args, Config) == [
        "train.max_step (did you mean train.max_steps?)",
        "drafter.nope.deep",
    ]


def test_a_key_inside_chat_template_kwargs_is_set_without_a_plus():
    """``data.chat_template_kwargs.enable_thinking=false`` (the documented spelling) adds the key to the
    free-form dict, and overrides it where an experiment already set it."""
    from dflash.config import Config
    from dflash.config.checks import free_form_overrides

    args = free_form_overrides(
        ["data.chat_template_kwargs.enable_thinking=false", "train.max_steps=3"], Config
    )
    assert args == ["++data.chat_template_kwargs.enable_thinking=false", "train.max_steps=3"]
    assert _compose(args).data.chat_template_kwargs == {"enable_thinking": False}
    twice = free_form_overrides(["data.chat_template_kwargs.enable_thinking=true"], Config)
    assert _compose([*args, *twice]).data.chat_template_kwargs == {"enable_thinking": True}


def test_typos_and_wrong_types_fail_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose(["topology.num_target=3"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["train.max_steps=lots"])


@pytest.mark.parametrize(
    "override,allowed",
    [
        ("logging.mode=loud", "[online, offline, disabled]"),
        ("drafter.attention=fast", "[auto, sdpa, flex]"),
        ("topology.backend=mpi", "[auto, nccl, gloo]"),
        ("target.dtype=fp8", "[auto, float32, bfloat16, float16]"),
        ("drafter.layer_types=[sliding,full_attention]", "[full_attention, sliding_attention]"),
        ("train.on_nonfinite=ignore", "[error, skip]"),
        ("data.overlong=cut", "[truncate, skip]"),
        ("optim.name=sgd", "[adamw, muon]"),
        ("optim.muon_adjust_lr=spectral", "[original, match_rms_adamw]"),
    ],
)
def test_a_bad_choice_fails_at_compose_time_naming_the_choices(override, allowed):
    with pytest.raises(ConfigCompositionException) as err:
        _compose([override])
    cause = str(err.value.__cause__)
    assert override in str(err.value) and allowed in cause and override.split("=")[0] in cause


BAD = [
    (["topology.num_targets=3"], 3, "WORLD_SIZE=3", "--nproc_per_node 4"),
    (["target.layer_ids=[]"], 3, "target.layer_ids", "at least one"),
    (["target.layer_ids=[1,-2]"], 3, "target.layer_ids", "negative"),
    (["target.layer_ids=[1,1]"], 3, "target.layer_ids", "duplicates"),
    (["target.layer_ids=[4,1,2]"], 3, "not in increasing order", "set target.layer_ids=[1, 2, 4]"),
    (["drafter.block_size=1"], 3, "drafter.block_size", ">= 2"),
    (["data.max_length=0"], 3, "data.max_length", ">= 2"),
    (["data.token_budget=100", "data.max_length=200"], 3, "data.token_budget", "data.token_budget=200"),
    (["train.save_every=0"], 3, "train.save_every", ">= 1"),
    (["loss.ce=0", "loss.kl=0", "loss.verifier_ce=0"], 3, "loss.ce", "loss.ce=1.0"),
    (["loss.temperature=0"], 3, "loss.temperature", "> 0"),
    (["drafter.mask_token_id=-1"], 3, "drafter.mask_token_id", ">= 0"),
    (["target.trust_remote_code=true"], 3, "target.revision", "40-hex"),
    (["train.keep_checkpoints=1"], 3, "train.keep_checkpoints", "at least 2"),
    (["optim.lr=0"], 3, "optim.lr", "> 0"),
    (["eval.every=5", "eval.num_prompts=0"], 3, "eval.num_prompts=0", "or set eval.every=0"),
    (["eval.every=5", "eval.max_new_tokens=0"], 3, "eval.max_new_tokens=0", "or set eval.every=0"),
    (
        ["eval.every=5", "data.num_eval_prompts=0"],
        3,
        "data.num_eval_prompts=0 holds out no",
        "data.num_eval_prompts=8",
    ),
    (["drafter.block_size=100000"], 3, "drafter.block_size=100000 is not below data.max_length", "public 16"),
    (["train.stop_after_steps=-1"], 3, "train.stop_after_steps=-1", ">= 1"),
    (["topology.num_drafters=1"], 1, "WORLD_SIZE=1", "torchrun --nproc_per_node 3"),
    (
        ["drafter.layer_types=[full_attention]"],
        3,
        "drafter.layer_types lists 1 layers",
        "one entry per layer",
    ),
    (
        ["drafter.layer_types=[sliding_attention,full_attention]"],
        3,
        "drafter.sliding_window=null",
        "drafter.sliding_window=<W",
    ),
    (["drafter.sliding_window=64"], 3, "drafter.sliding_window=64 but no", "drafter.sliding_window=null"),
    (
        ["drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=4"],
        3,
        "drafter.sliding_window=4",
        ">= drafter.block_size=8",
    ),
    (["drafter.partial_rotary_factor=1.5"], 3, "drafter.partial_rotary_factor=1.5", "(0, 1]"),
    (["loss=dpace", "loss.kl=0.5"], 3, "loss.dpace=0.5 with loss.kl=0.5", "set loss.kl=0"),
    (["loss.dpace=1.5"], 3, "loss.dpace=1.5", "(0, 1]"),
    (["loss=dpace", "loss.dpace_normalizer=mean"], 3, "loss.dpace_normalizer=mean", "sum or count"),
    (["optim.beta2=1.0"], 3, "optim.beta2=1.0", "[0, 1)"),
    (["optim=muon", "optim.muon_lr=0"], 3, "optim.muon_lr=0", "or null (= optim.lr)"),
    (["optim=muon", "optim.muon_momentum=1.2"], 3, "optim.muon_momentum=1.2", "[0, 1)"),
    (["optim=muon", "optim.muon_ns_steps=0"], 3, "optim.muon_ns_steps=0", "[1, 99]"),
    (["optim=muon", "optim.muon_weight_decay=-0.1"], 3, "optim.muon_weight_decay=-0.1", ">= 0"),
]


@pytest.mark.parametrize("overrides,world,field,fix", BAD, ids=[b[2] + ":" + b[0][0] for b in BAD])
def test_bad_configs_name_the_field_and_the_fix(overrides, world, field, fix):
    cfg = _compose(overrides)
    with pytest.raises(ValueError) as err:
        validate(cfg, world)
    assert field in str(err.value) and fix in str(err.value)


def test_all_problems_are_reported_at_once():
    cfg = _compose(["train.save_every=0", "optim.lr=0", "drafter.block_size=1"])
    with pytest.raises(ValueError, match="3 config problem"):
        validate(cfg, 3)


def test_config_is_a_typed_dataclass():
    cfg = _compose([])
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg.topology.num_targets, int)


# ----------------------------------------------------------------------------------------------
# Resume contract and dataset fingerprint come from the schema's field tags


def test_every_schema_field_is_tagged_for_resume():
    """A field that changes behaviour but is left out of the contract lets a resume silently mix
    incompatible state: every leaf must say CONTRACT, derived(<resolved key>) or FREE."""
    untagged, unknown = [], []
    for name, f in schema_leaves(Config):
        kind = f.metadata.get("resume")
        if kind not in RESUME_KINDS:
            untagged.append(name)
        elif kind == "derived" and f.metadata.get("covered_by") not in RESOLVED_CONTRACT_KEYS:
            unknown.append(f"{name} -> {f.metadata.get('covered_by')}")
    assert not untagged, f"schema fields without a resume tag (CONTRACT / derived(...) / FREE): {untagged}"
    assert not unknown, f"derived fields covered by no resolved contract entry: {unknown}"


def test_every_data_field_says_whether_it_shapes_the_dataset():
    missing = [f.name for f in dataclasses.fields(DataConfig) if not isinstance(f.metadata.get("data"), bool)]
    assert not missing, f"DataConfig fields without data=True/False (dataset fingerprint): {missing}"


def test_contract_holds_the_tagged_values_and_follows_a_change():
    cfg = _compose([])
    values = contract_values(cfg)
    tagged = {name for name, f in schema_leaves(Config) if f.metadata.get("resume") == "contract"}
    # A None sub-config is one value; a set one contributes its own tagged leaves instead.
    assert set(values) == {n for n in tagged if n != "target.tiny"}
    assert values["optim.lr"] == cfg.optim.lr and "train.save_every" not in values
    assert contract_values(_compose(["optim.lr=1e-3"]))["optim.lr"] == 1e-3
    assert contract_values(_compose(["target=qwen3_8b"]))["target.tiny"] is None


def test_dataset_settings_are_the_data_tagged_fields():
    cfg = _compose([])
    settings = dataset_settings(cfg.data)
    assert {
        "max_length",
        "split",
        "overlong",
        "train_only_last_turn",
        "num_samples",
        "num_eval_prompts",
    } <= set(settings)
    assert "token_budget" not in settings and "cache_dir" not in settings


def test_flex_guard_uses_the_resolved_device(monkeypatch):
    """topology.device=auto on a machine with a GPU resolves to flex attention: the static-shape cap
    is required there, and the config error says so before anything runs."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _compose(["topology.device=auto", "drafter.attention=auto", "drafter.max_anchors_per_packet=null"])
    with pytest.raises(ValueError, match=r"drafter\.max_anchors_per_packet=null with flex attention"):
        validate(cfg, 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    validate(cfg, 3)  # auto on a CPU machine is sdpa: no static shape needed


def test_num_taps_must_match_explicit_layer_ids():
    cfg = _compose(["target.layer_ids=[1,2]", "target.num_taps=5"])
    with pytest.raises(ValueError, match=r"target\.num_taps=5 but target\.layer_ids lists 2 layers"):
        validate(cfg, 3)


def test_world_size_fix_is_one_validation_accepts():
    """Plain ``python -m dflash.train`` (WORLD_SIZE=1) must not be told to set num_targets=0."""
    with pytest.raises(ValueError) as err:
        validate(_compose([]), 1)
    assert "num_targets=0" not in str(err.value)


def test_unknown_keys_are_refused_with_the_closest_known_key():
    register_configs()
    dcfg = compose_config("config", ["+train.max_step=5", "+logging.api_key=abc"])
    with pytest.raises(UserError) as err:
        check_known_keys(dcfg, Config)
    assert "train.max_step (did you mean train.max_steps?)" in str(err.value) and "logging.api_key" in str(
        err.value
    )


def test_user_data_with_eval_holds_out_conversations_by_default():
    cfg = _compose(
        ["data=chat_jsonl", "data.path=/d.jsonl"]
    )  # the default experiment evaluates every 50 steps
    assert cfg.eval.every > 0 and cfg.data.num_eval_prompts == cfg.eval.num_prompts
    validate(cfg, 3)
    assert _compose(["data=chat_jsonl", "data.path=/d.jsonl", "eval.every=0"]).data.num_eval_prompts == 0


def test_drafter_nodes_give_the_last_nodes_to_the_drafters(monkeypatch):
    """Two nodes of 8: ``drafter_nodes=1`` makes ranks 0-7 targets and ranks 8-15 drafters, whatever
    num_targets the experiment had; one node or a fixed num_drafters is refused with the fix."""
    cfg = _compose(
        [
            "experiment=qwen3_8b_8gpu",
            "data.path=/d.jsonl",
            "topology.drafter_nodes=1",
            "topology.num_drafters=null",
        ]
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    validate(cfg, 16)
    topo = Topology.from_config(cfg.topology, 16)
    assert (topo.num_targets, topo.num_drafters) == (8, 8)
    assert (topo.role_of(7), topo.role_of(8), topo.leader_rank) == ("target", "drafter", 8)
    with pytest.raises(ValueError, match="needs at least one node of targets"):
        validate(cfg, 8)
    fixed = _compose(["experiment=qwen3_8b_8gpu", "data.path=/d.jsonl", "topology.drafter_nodes=1"])
    with pytest.raises(ValueError, match="topology.num_drafters=null"):
        validate(fixed, 16)


APP_SCHEMAS = {
    "dflash.train": "dflash.config:Config",
    "dflash.eval": "dflash.eval.config:EvalAppConfig",
    "dflash.data.prepare": "dflash.data.prepare:PrepareConfig",
    "dflash.data.regenerate": "dflash.data.regenerate.config:RegenerateConfig",
    "dflash.serve_check": "dflash.serve_check.config:ServeCheckConfig",
    "dflash.report": "dflash.report:ReportAppConfig",
}


@pytest.mark.parametrize("app", list(APP_SCHEMAS))
def test_every_field_of_every_app_is_documented(app):
    """``python -m <app> --help`` prints each field with its documentation: none may lack one."""
    import importlib

    from dflash.config.help import field_docs

    module, name = APP_SCHEMAS[app].split(":")
    schema = getattr(importlib.import_module(module), name)
    undocumented = [d.key for d in field_docs(schema) if not d.doc]
    assert undocumented == [], f"{app}: fields without documentation: {undocumented}"


def test_train_help_prints_every_field_with_its_default_and_meaning():
    from ranks import run_module

    from dflash.config.help import field_docs

    out = run_module("dflash.train", ["--help"], env=dict(os.environ), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for d in field_docs(Config):
        assert f"{d.key}:" in out.stdout, d.key
    assert "  train.max_steps: int | None = None" in out.stdout and "W&B entity" in out.stdout
    assert "  fault." not in out.stdout  # fault injection is the test launcher's, not a user's config
