"""Tensor-parallel target replicas: one frozen target sharded over the k ranks of a replica.

A replica is a process group of k ranks (``topology.target_tp``) holding one ``*ForCausalLM`` whose
weights are DTensors sharded with the model's own transformers plans: ``base_model_tp_plan``
(attention heads and MLP width column/row-wise, the embedding by vocabulary rows, the lm_head by
columns) and, for mixture-of-experts targets that have one, ``base_model_ep_plan`` (each rank holds
``num_experts / k`` whole experts, runs them on the tokens routed to them and the replica sums the
outputs: transformers' ``all_reduce`` expert implementation). A model whose expert count k does not
divide splits every expert's FFN width instead (``moe_tp_experts``): with the TP plan's own rules where
transformers ships them (5.24), else with :data:`EXPERT_WIDTH_RULES` where the experts are the fused
``gate_up_proj`` / ``down_proj`` pair those rules split and transformers still has the style (5.25
dropped the rules from the Qwen3-MoE plans but keeps the style until 5.28); otherwise the shape is
refused naming the fix (a k that divides the experts), never replicated in silence.
Rowwise layers and the expert sum end in an all-reduce, so every rank of a replica sees the same
full residual stream: the tap outputs and the final norm output are plain replicated tensors, and
any rank can send a packet.

Loading goes through ``from_pretrained(distributed_config=DistributedConfig(tp_size=k, ...))``: the
model is built on the meta device, sharded, and each rank materialises only its slices of the
safetensors (``DtensorShardOperation`` on safetensors slices): its private host memory grows by its
shard, never by the whole model (tests/multiproc/test_tp_loading_memory.py). The file itself is
memory-mapped: a column slice of a row-split weight (o_proj, down_proj) reads every page of that
weight into the page cache, which the ranks of a host share.
transformers builds its device mesh over the whole world (``initialize_distributed_mesh`` requires
the mesh to cover ``WORLD_SIZE``), while a dflash world also holds other replicas and the drafters:
:func:`replica_mesh` substitutes a mesh over the replica's own process group for the duration of
one ``from_pretrained`` call (``transformers.distributed.mixin.initialize_distributed_mesh``, the
one name it replaces, checked to exist). No new process group is created there: the mesh is built
with ``DeviceMesh.from_group`` on the group the caller made for the replica
(:func:`dflash.distributed.process_group.new_replica_groups`).

:func:`tp_layout` needs no process group and builds nothing (it reads transformers' plan tables):
what the plans split for a model type and k, shared by the loader and the planner (``dflash.plan``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash.targets.families import PARTS, family_of

if TYPE_CHECKING:
    import torch

    from dflash.config import TargetShape

PART_PREFIXES = {name: part.prefixes for name, part in PARTS.items() if part.prefixes}
"""Parts of a decoder layer, named by the module prefixes of transformers' plans (``layers.*.<prefix>``)."""

SHARDING_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "packed_colwise",
    "packed_rowwise",
    "moe_tp_experts",
    "embedding_rowwise",
)
"""Plan styles that split a weight over the replica (``replicated_*`` styles keep it whole)."""

EXPERT_WIDTH_RULES = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
"""TP rules that split every expert's FFN width k ways (what transformers 5.24's Qwen3-MoE and
Qwen3.5-MoE plans held): gate_up column-wise in its two packed halves, down row-wise, and the
experts' partial outputs summed over the replica."""
FUSED_EXPERT_PARAMS = frozenset({"layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj"})
"""The expert weights of an EP plan that :data:`EXPERT_WIDTH_RULES` fit (no biases, no other tensors)."""


@dataclass(frozen=True)
class TpLayout:
    """What one rank of a k-rank replica holds of a target: which parts are split k ways.

    ``parts`` names the split parts of a decoder layer (keys of :data:`PART_PREFIXES`), plus
    ``embedding`` and ``lm_head``; everything else (norms, routers, gates, the parts of a model
    whose plan leaves them whole, e.g. gpt-oss attention) is replicated on every rank.
    """

    tp_size: int
    parts: frozenset[str]
    experts: str
    """``ep`` (whole experts per rank), ``tp`` (every expert's FFN width split), ``replicated``, or
    ``none`` (a dense model)."""

    def split(self, part: str) -> bool:
        return self.tp_size > 1 and part in self.parts

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.experts == "ep" else 1


def _plan_parts(plan: dict[str, str]) -> set[str]:
    """The parts of :data:`PART_PREFIXES` that some rule of ``plan`` splits."""
    parts = set()
    for key, style in plan.items():
        if style not in SHARDING_STYLES:
            continue
        rest = key.split("layers.*.", 1)[-1]
        parts |= {p for p, prefixes in PART_PREFIXES.items() if rest.startswith(prefixes)}
        if rest.startswith("embed_tokens"):
            parts.add("embedding")
    return parts


def causal_lm_class(model_type: str) -> Any:
    """transformers' ``*ForCausalLM`` class of ``model_type`` (None when it has none)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)


def model_plans(model_type: str) -> tuple[dict[str, str], dict[str, str], bool]:
    """``(base_model_tp_plan, base_model_ep_plan, lm_head split)`` transformers ships for ``model_type``.

    The embedding is split whenever the TP plan is non-empty (transformers adds ``embed_tokens:
    embedding_rowwise``); the lm_head rule is on the ``*ForCausalLM`` class (``_tp_plan``).
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"target model_type {model_type!r} is unknown to transformers {transformers.__version__}"
        )
    config_cls = CONFIG_MAPPING[model_type]
    tp_plan = dict(getattr(config_cls, "base_model_tp_plan", None) or {})
    ep_plan = dict(getattr(config_cls, "base_model_ep_plan", None) or {})
    if tp_plan:
        tp_plan = {"embed_tokens": "embedding_rowwise", **tp_plan}
    head_plan = getattr(causal_lm_class(model_type), "_tp_plan", None) or {}
    return tp_plan, ep_plan, head_plan.get("lm_head") in SHARDING_STYLES


def own_expert_width_rules(model_type: str) -> dict[str, str]:
    """:data:`EXPERT_WIDTH_RULES` when ``model_type``'s TP plan has no expert-width split of its own
    but its experts are the fused pair those rules split and transformers still registers the
    ``moe_tp_experts`` style; else ``{}`` (the plan splits them itself, or nothing can)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    tp_plan, ep_plan, _ = model_plans(model_type)
    if "experts" in _plan_parts(tp_plan) or "moe_tp_experts" not in ALL_PARALLEL_STYLES:
        return {}
    weights = {k for k in ep_plan if k != "layers.*.mlp.experts"}
    return dict(EXPERT_WIDTH_RULES) if weights == FUSED_EXPERT_PARAMS else {}


def tp_layout(model_type: str, num_experts: int, tp_size: int) -> TpLayout:
    """How a ``tp_size``-rank replica shards a ``model_type`` target with ``num_experts`` experts.

    Experts: expert parallelism when transformers has an EP plan for the model and ``tp_size``
    divides ``num_experts``, else every expert's width split (the TP plan's ``moe_tp_experts`` rules,
    or :func:`own_expert_width_rules`), else replicated (which :func:`tp_problems` refuses). A
    planner shape without a model type goes through :func:`shape_layout`. Raises ``ValueError`` when ``tp_size > 1`` and transformers has no plan for the model.
    """
    tp_plan, ep_plan, head_split = model_plans(model_type)
    if tp_size > 1 and not tp_plan and not ep_plan:
        raise ValueError(
            f"topology.target_tp={tp_size}: transformers has no tensor-parallel plan for model_type "
            f"{model_type!r}; set topology.target_tp=1"
        )
    parts = _plan_parts(tp_plan) - {"experts"}
    if head_split:
        parts.add("lm_head")
    experts = "none"
    if num_experts:
        parts.discard("mlp")  # every layer of the MoE targets dflash knows is sparse
        if ep_plan and num_experts % tp_size == 0:
            experts = "ep"
        elif "experts" in _plan_parts(tp_plan) or own_expert_width_rules(model_type):
            experts = "tp"
        else:
            experts = "replicated"
        if experts != "replicated":
            parts.add("experts")
    return TpLayout(tp_size, frozenset(parts), experts)


def tp_problems(
    layout: TpLayout, *, num_heads: int, num_kv_heads: int, num_experts: int, moe_intermediate_size: int
) -> list[str]:
    """Why ``layout`` cannot shard this shape (each problem names ``topology.target_tp`` and a fix)."""
    k = layout.tp_size
    if k <= 1:
        return []
    problems = []
    if layout.split("attention") and (num_heads % k or num_kv_heads % k):
        problems.append(
            f"topology.target_tp={k}: the target's {num_heads} query / {num_kv_heads} key-value heads "
            f"are split by heads, so target_tp must divide both; use a divisor of {num_kv_heads}"
        )
    if layout.experts == "tp" and moe_intermediate_size % k:
        problems.append(
            f"topology.target_tp={k}: the experts' FFN width {moe_intermediate_size} is split k ways; "
            f"use a divisor of {moe_intermediate_size}"
        )
    if num_experts and layout.experts == "replicated":
        problems.append(
            f"topology.target_tp={k}: transformers can split neither the {num_experts} experts (no EP plan, "
            f"or {k} does not divide them) nor their width: use a divisor of {num_experts}"
        )
    return problems


def shape_layout(shape: TargetShape, tp_size: int) -> TpLayout:
    """:func:`tp_layout` of a target shape: its ``model_type``, else the first model type of the
    family its shape implies (``dflash.targets.families.family_of``)."""
    model_type = shape.model_type or family_of(None, shape).model_types[0]
    return tp_layout(model_type, shape.num_experts, tp_size)


def tp_shape_problems(shape: TargetShape, tp_size: int) -> list[str]:
    """Why a target of ``shape`` cannot be sharded over ``tp_size``-rank replicas (transformers'
    plans, no model built); empty when it can, or when ``tp_size`` is 1."""
    if tp_size <= 1:
        return []
    try:
        layout = shape_layout(shape, tp_size)
    except ValueError as e:
        return [str(e)]
    return tp_problems(
        layout,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        num_experts=shape.num_experts,
        moe_intermediate_size=shape.moe_intermediate_size,
    )


def num_experts_of(text_config: Any) -> int:
    """Routed experts of a transformers text config (0 for a dense model; gpt-oss maps
    ``num_experts`` to ``num_local_experts``)."""
    return int(getattr(text_config, "num_experts", 0) or 0)


def distributed_config(text_config: Any, tp_size: int) -> Any:
    """The ``transformers.distributed.DistributedConfig`` that shards this target over ``tp_size``
    ranks (EP with ``all_reduce``, since the ranks of a replica share one batch); ``ValueError``
    naming ``topology.target_tp`` when the shape cannot be split that way."""
    from transformers.distributed import DistributedConfig

    num_experts = num_experts_of(text_config)
    layout = tp_layout(str(text_config.model_type), num_experts, tp_size)
    problems = tp_problems(
        layout,
        num_heads=int(text_config.num_attention_heads),
        num_kv_heads=int(
            getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        ),
        num_experts=num_experts,
        moe_intermediate_size=int(
            getattr(text_config, "moe_intermediate_size", None)
            or getattr(text_config, "intermediate_size", 0)
            or 0
        ),
    )
    if problems:
        raise ValueError("; ".join(problems))
    if layout.experts == "ep":
        return DistributedConfig(
            tp_size=layout.tp_size, ep_size=layout.tp_size, ep_implementation="all_reduce"
        )
    if layout.experts == "tp":
        model_type = str(text_config.model_type)
        own = own_expert_width_rules(model_type)
        if own:  # merged by from_pretrained over the causal LM's plan, whose keys name the base model
            prefix = causal_lm_class(model_type).base_model_prefix
            return DistributedConfig(
                tp_size=layout.tp_size, tp_plan={f"{prefix}.{k}": v for k, v in own.items()}
            )
    return DistributedConfig(tp_size=layout.tp_size)


@contextmanager
def replica_mesh(group: Any, device: torch.device) -> Iterator[None]:
    """Inside the block, transformers' ``from_pretrained(distributed_config=...)`` shards over the
    ranks of ``group`` (one replica) instead of the whole world (see the module docstring).

    The dense ("tp") and expert ("ep") meshes are both the replica's ranks: with
    ``tp_size == ep_size`` and no FSDP or pipeline axis every other mesh axis has size 1, so
    every mesh transformers asks for is this one-dimensional mesh.
    """
    import transformers.distributed.mixin as mixin
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    if not hasattr(mixin, "initialize_distributed_mesh"):
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} has no transformers.distributed.mixin."
            "initialize_distributed_mesh: tensor-parallel targets need the transformers version dflash "
            "was tested with (5.24); set topology.target_tp=1"
        )
    meshes = {
        name: DeviceMesh.from_group(group, device.type, mesh_dim_names=(name,)) for name in ("tp", "ep")
    }

    class ReplicaMesh(TransformersDeviceMesh):
        def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
            dims = (dims,) if isinstance(dims, str) else tuple(dims)
            name = "ep" if "ep" in dims else "tp"
            if name not in dims:
                raise RuntimeError(f"a target replica has no {dims} mesh (only tensor/expert parallel)")
            return meshes[name]

    def initialize_replica_mesh(_config: Any) -> tuple[torch.device, ReplicaMesh]:
        return device, ReplicaMesh(meshes["tp"], meshes["ep"])

    original = mixin.initialize_distributed_mesh
    setattr(mixin, "initialize_distributed_mesh", initialize_replica_mesh)  # noqa: B010 - typed differently
    try:
        yield
    finally:
        setattr(mixin, "initialize_distributed_mesh", original)  # noqa: B010


def local_num_bytes(model: Any) -> int:
    """Bytes of this rank's parameters: the local shard of every DTensor plus every replicated tensor."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
