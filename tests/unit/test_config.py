"""Hydra composition of every experiment, overrides, and config errors that name the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError
from testpaths import REPO

from dflash.config import Config, register_configs, to_config, validate

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def _compose(overrides: list[str]) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def test_required_experiments_exist():
    assert {"tiny_cpu", "qwen3_8b_7x1", "qwen3_6_27b_7x1"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = _compose([f"experiment={experiment}", "data.path=/data/chat.jsonl"])
    assert cfg.name == experiment
    validate(cfg, cfg.topology.num_targets + cfg.topology.num_drafters)


def test_default_is_the_embedded_cpu_run():
    cfg = _compose([])
    assert cfg.name == "tiny_cpu" and cfg.data.path == "embedded" and cfg.target.tiny is not None
    assert (cfg.topology.num_targets, cfg.topology.num_drafters, cfg.topology.backend) == (2, 1, "gloo")


def test_qwen3_6_27b_experiment_matches_the_published_drafter():
    cfg = _compose(["experiment=qwen3_6_27b_7x1", "data.path=/d.jsonl"])
    assert cfg.target.layer_ids == [1, 16, 31, 46, 61] and cfg.drafter.mask_token_id == 248070
    assert cfg.topology.num_targets == 7 and not cfg.target.pack


def test_any_value_is_overridable():
    cfg = _compose(["train.max_steps=100", "target=qwen3_8b", "topology.num_targets=7", "loss=ce_kl", "loss.temperature=2.0"])
    assert cfg.train.max_steps == 100 and cfg.target.name == "qwen3_8b" and cfg.topology.num_targets == 7
    assert cfg.loss.kl == 1.0 and cfg.loss.temperature == 2.0


def test_typos_and_wrong_types_fail_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose(["topology.num_target=3"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["train.max_steps=lots"])


BAD = [
    (["topology.num_targets=3"], 3, "WORLD_SIZE=3", "--nproc_per_node 4"),
    (["target.layer_ids=[]"], 3, "target.layer_ids", "at least one"),
    (["target.layer_ids=[1,-2]"], 3, "target.layer_ids", "negative"),
    (["target.layer_ids=[1,1]"], 3, "target.layer_ids", "duplicates"),
    (["drafter.block_size=1"], 3, "drafter.block_size", ">= 2"),
    (["data.max_length=0"], 3, "data.max_length", ">= 2"),
    (["data.token_budget=100", "data.max_length=200"], 3, "data.token_budget", "data.token_budget=200"),
    (["train.save_every=0"], 3, "train.save_every", ">= 1"),
    (["loss.ce=0", "loss.kl=0", "loss.verifier_ce=0"], 3, "loss.ce", "loss.ce=1.0"),
    (["loss.temperature=0"], 3, "loss.temperature", "> 0"),
    (["logging.mode=loud"], 3, "logging.mode", "one of"),
    (["drafter.mask_token_id=-1"], 3, "drafter.mask_token_id", ">= 0"),
    (["target.trust_remote_code=true"], 3, "target.revision", "40-hex"),
    (["train.keep_checkpoints=1"], 3, "train.keep_checkpoints", "at least 2"),
    (["optim.lr=0"], 3, "optim.lr", "> 0"),
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
