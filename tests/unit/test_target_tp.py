"""What a tensor-parallel replica splits, read from transformers' own plans, the shapes it refuses,
and the tiny MoE target built from conf/target/tiny_moe.yaml."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from testpaths import REPO

from dflash.config import TargetShape, TinyTargetConfig
from dflash.sizing.inputs import shape_problems
from dflash.targets.loader import read_target_meta
from dflash.targets.tiny import build_model
from dflash.targets.tp import distributed_config, tp_layout, tp_problems, tp_shape_problems


def test_layouts_follow_the_transformers_plans():
    llama = tp_layout("llama", 0, 8)
    assert llama.parts == {"attention", "mlp", "embedding", "lm_head"} and llama.experts == "none"
    moe = tp_layout("qwen3_moe", 128, 4)
    assert moe.parts == {"attention", "experts", "embedding", "lm_head"} and moe.ep_size == 4
    # 5 experts cannot go whole to 2 ranks: every expert's FFN width is split (moe_tp_experts; with
    # transformers 5.25's plans, which no longer hold those rules, dflash's own EXPERT_WIDTH_RULES)
    assert tp_layout("qwen3_moe", 5, 2).experts == "tp" and tp_layout("qwen3_moe", 5, 2).ep_size == 1
    oss = tp_layout("gpt_oss", 128, 4)  # its plan splits experts and embedding only
    assert oss.experts == "ep" and not oss.split("attention") and oss.split("embedding")
    hybrid = tp_layout("qwen3_5_moe_text", 256, 2)
    assert {"linear_attention", "shared_expert", "experts", "attention"} <= hybrid.parts
    assert not tp_layout("qwen3", 0, 1).split("attention")  # one rank splits nothing


def test_expert_width_split_is_our_own_plan_where_transformers_dropped_it(monkeypatch):
    """transformers 5.25's Qwen3-MoE plans split experts only whole (EP): a count k does not divide is
    split by width with dflash's own rules, passed to from_pretrained under the base model's prefix;
    once transformers drops the style itself (5.28), the shape is refused naming the fix."""
    import transformers.distributed.tensor_parallel as hf_tp

    from dflash.targets.tp import EXPERT_WIDTH_RULES, model_plans, own_expert_width_rules

    tp_plan, _, _ = model_plans("qwen3_moe")
    ships_rules = "moe_tp_experts" in tp_plan.values()  # transformers 5.24
    assert own_expert_width_rules("qwen3_moe") == ({} if ships_rules else EXPERT_WIDTH_RULES)
    assert own_expert_width_rules("gpt_oss") == {}  # biased experts: no rule of ours fits them
    config = build_model(_moe_spec(num_experts=5), 300, 1, 0).config
    dist = distributed_config(config, 2)
    assert dist.tp_size == 2 and (dist.ep_size or 1) == 1
    if ships_rules:
        return
    assert dist.tp_plan == {f"model.{k}": v for k, v in EXPERT_WIDTH_RULES.items()}
    styles = {k: v for k, v in hf_tp.ALL_PARALLEL_STYLES.items() if k != "moe_tp_experts"}
    monkeypatch.setattr(hf_tp, "ALL_PARALLEL_STYLES", styles)
    assert tp_layout("qwen3_moe", 5, 2).experts == "replicated"
    with pytest.raises(ValueError, match="use a divisor of 5"):
        distributed_config(config, 2)


def test_shapes_a_replica_cannot_split_are_refused_naming_the_field():
    problems = tp_problems(
        tp_layout("qwen3_moe", 128, 8),
        num_heads=64,
        num_kv_heads=4,
        num_experts=128,
        moe_intermediate_size=1536,
    )
    assert len(problems) == 1 and "topology.target_tp=8" in problems[0] and "divisor of 4" in problems[0]
    gpt = tp_layout("gpt_oss", 6, 4)  # no EP over 4 ranks for 6 experts, and no TP rule for them
    assert gpt.experts == "replicated"
    assert (
        "divisor of 6"
        in tp_problems(gpt, num_heads=64, num_kv_heads=8, num_experts=6, moe_intermediate_size=8)[0]
    )
    config = build_model(_moe_spec(), 300, 1, 0).config  # 4 heads, 2 KV heads: 4 ranks are too many
    with pytest.raises(ValueError, match="topology.target_tp=4"):
        distributed_config(config, 4)
    assert distributed_config(config, 2).ep_size == 2  # 8 experts: expert parallel


def test_config_problems_name_target_tp_before_anything_loads(monkeypatch):
    from dflash.cli import compose_config
    from dflash.config import register_configs
    from dflash.config.checks import config_problems
    from dflash.plan.app import plan_config

    register_configs()

    def problems(*overrides: str, local_world_size: int = 8, world: int = 16) -> list[str]:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        cfg = plan_config(compose_config("plan_app", ["experiment=qwen3_235b_a22b_16gpu", *overrides]))
        mine = [p for p in config_problems(cfg, world) if "target_tp" in p]
        assert cfg.target.shape is not None
        return mine + tp_shape_problems(cfg.target.shape, cfg.topology.target_tp)

    assert problems() == []  # the shipped 2 x TP=4 + 8 drafters
    bad = problems(
        "topology.target_tp=8",
        "topology.num_targets=1",
        "topology.num_drafters=4",
        "eval.every=100",
        local_world_size=4,
        world=12,
    )
    assert len(bad) == 3 and all("topology.target_tp=8" in p for p in bad)
    assert "LOCAL_WORLD_SIZE=4" in bad[0] and "eval.every=100" in bad[1] and "4 key-value heads" in bad[2]
    colocated = problems("topology=colocated", "topology.target_tp=4", world=4)
    assert "topology.mode=colocated with topology.target_tp=4" in colocated[0]


def _moe_spec(**kw) -> TinyTargetConfig:
    spec = OmegaConf.to_container(OmegaConf.load(REPO / "conf/target/tiny_moe.yaml").tiny)
    assert isinstance(spec, dict)
    return TinyTargetConfig(**{**spec, **kw})


def test_tiny_moe_target_is_built_like_the_dense_one(tiny_moe_target_dir):
    """ensure_tiny_target builds the MoE spec of conf/target/tiny_moe.yaml (tokenizer included); its
    config.json gives the YAML's planner shape."""
    shape = read_target_meta(str(tiny_moe_target_dir))
    declared = OmegaConf.to_container(OmegaConf.load(REPO / "conf/target/tiny_moe.yaml").shape)
    assert isinstance(declared, dict) and shape_problems(TargetShape(**declared), shape) == []
    assert (shape.num_experts, shape.model_type) == (8, "qwen3_moe")
    assert (tiny_moe_target_dir / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="target.tiny.num_experts=0"):
        build_model(_moe_spec(num_experts=0), 300, 1, 0)


BIG_TARGETS = (
    "llama3_3_70b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "qwen3_5_35b_a3b",
    "gpt_oss_20b",
    "gpt_oss_120b",
)


@pytest.mark.parametrize("name", BIG_TARGETS)
def test_big_target_shapes_are_what_their_config_json_gives(name, tmp_path):
    """A config.json written by transformers' own config class from the YAML's values reads back as
    the YAML's planner shape (field names, the hybrid layer count, the expert fields)."""
    from transformers import AutoConfig

    declared = OmegaConf.to_container(OmegaConf.load(REPO / f"conf/target/{name}.yaml").shape)
    assert isinstance(declared, dict)
    s = TargetShape(**declared)
    kw: dict = dict(
        num_hidden_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        vocab_size=s.vocab_size,
        tie_word_embeddings=s.tie_word_embeddings,
    )
    if s.model_type != "qwen3_5_moe_text":  # its text config has no dense FFN width
        kw["intermediate_size"] = s.intermediate_size
    if s.num_experts:
        kw.update(num_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_tok)
    if s.model_type in ("qwen3_moe", "qwen3_5_moe_text"):
        kw["moe_intermediate_size"] = s.moe_intermediate_size
    if s.shared_expert_intermediate_size:
        kw["shared_expert_intermediate_size"] = s.shared_expert_intermediate_size
    if s.num_linear_layers:
        kw.update(
            linear_num_key_heads=s.linear_num_key_heads,
            linear_num_value_heads=s.linear_num_value_heads,
            linear_key_head_dim=s.linear_key_head_dim,
            linear_value_head_dim=s.linear_value_head_dim,
            linear_conv_kernel_dim=s.linear_conv_kernel_dim,
        )
    assert s.model_type is not None
    AutoConfig.for_model(s.model_type, **kw).save_pretrained(tmp_path)
    assert shape_problems(s, read_target_meta(str(tmp_path))) == []
