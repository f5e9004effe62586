"""The real-size rehearsal: each role's training step on CPU fake tensors, GPU code paths, peak memory.

What runs is the library code the job runs, at the config's real shapes, on the packet the planner
assumes (:func:`dflash.sizing.inputs.typical_packet`: ``num_seqs`` samples of the mean length, or with
padded rows the data plan's own packet of the most target work, the last ``supervised_fraction`` of
each under the loss mask):

- ``target``: the frozen ``*ForCausalLM`` built from its config (``config.json`` when on disk, else
  ``target.shape``) in the target dtype; the headless forward of one packet
  (:func:`dflash.targets.forward.target_forward`), the packet gathered and checked for finite values as
  the packet maker does, with ``topology.max_in_flight`` earlier packets still in flight;
- ``drafter``: the frozen embedding and lm_head, the DFlash model (fp32 master weights) with the
  gradients and AdamW moments it holds from its second step on, the received packet
  (:func:`dflash.distributed.protocol.payload_buffers`), and one training step (anchors,
  :func:`dflash.drafter.objective.dflash_loss` under autocast, backward, gradient scale, clip, AdamW);
- ``colocated``: the target and the drafter in one process, the drafter on the target's own embedding
  and lm_head; per step the target forward, then the drafter step on its packet.

GPU paths: tensors are fake (:mod:`dflash.plan.fake`: shapes only, small index tensors real) on the CPU
device; the loss takes its CUDA branches (:func:`dflash.loss.device.as_cuda`: bf16 GEMM operands with
fp32 output, the bf16 copy of the logit gradient, 256-row scratch, no kept workspace); autocast is CPU
autocast in the drafter dtype, whose casts match CUDA autocast on every op of the step (the CPU and
CUDA lists of ATen agree on GEMMs and attention; :data:`CUDA_FP32_OPS` lists the ops CUDA alone runs in
fp32, and a step that runs one on a low-precision tensor is reported); flex attention runs its HOP
without Dynamo on the fake tensors (the autograd Function saves what the compiled kernel saves) and
the block mask is built eagerly and not counted (CUDA compiles it into one kernel); SDPA gets the
additive mask the CUDA composite makes from a boolean one.

Not measured (add ``plan.reserved_gib``): the CUDA context, NCCL buffers, cuBLAS/cuDNN workspaces,
allocator rounding and fragmentation, and kernels whose CUDA implementations differ from the CPU
ones (the hybrid target's linear attention runs transformers' torch fallback here; flex and
flash-attention targets run SDPA without a mask, see ``make_packet``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode

from dflash.config import Config
from dflash.config.resolve import torch_dtype
from dflash.distributed.protocol import (
    DTYPE_CODES,
    KIND_DATA,
    PROTOCOL_VERSION,
    Header,
    Packet,
    packet_from_payload,
    payload_buffers,
)
from dflash.distributed.sharding import (
    clip_grad_norm_,
    drafter_mesh,
    is_sharded,
    shard_drafter,
    unsynced_backward,
)
from dflash.drafter.families import build_drafter as new_drafter
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.optim import build_optimizer
from dflash.drafter.step import StepPlan, objective_step, plan_anchors
from dflash.loss.device import as_cuda
from dflash.plan.fake import Allocation, LiveBytes, Peak, RealSmall, uncounted_by
from dflash.sizing.costs import PacketShape
from dflash.sizing.fit import with_anchor_cap
from dflash.sizing.inputs import PlanInputs, local_config_dir, plan_device
from dflash.sizing.memory import GIB, PLAIN, DrafterSettings
from dflash.targets.families import fake_config, family_of
from dflash.targets.forward import build_batch, gather_tokens, target_forward
from dflash.targets.linear_attention import install_varlen, whole_row_delta_rule
from dflash.targets.loader import target_embed_and_head

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ROLES = ("target", "drafter", "colocated")
LIMITS = (
    "not measured: CUDA context, NCCL buffers, cuBLAS/cuDNN workspaces, allocator rounding and "
    "fragmentation (plan.reserved_gib stands for them)"
)
PHASE_TERMS = {"drafter_forward": "loss_workspace", "loss": "other", "backward": "activations"}
"""``dflash_loss``'s ``on_phase`` names -> the term of what is allocated after them."""
CUDA_FP32_OPS = frozenset(
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
    "layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
    "nll_loss nll_loss2d kl_div l1_loss smooth_l1_loss huber_loss mse_loss binary_cross_entropy_with_logits "
    "dist pdist cdist renorm logsumexp prod softmax log_softmax cumprod cumsum linalg_vector_norm "
    "linalg_matrix_norm sum norm".split()
)
"""Ops CUDA autocast runs in fp32 and CPU autocast leaves in their input dtype (ATen's
``autocast_mode.h`` lists AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE; the losses and
upsampling ops nobody here runs are left out)."""


@dataclass(frozen=True)
class RoleMeasurement:
    """One role's rehearsed step: its peak of live tensor bytes, what was live then."""

    role: str
    peak_bytes: int
    by_term: dict[str, int]
    """Bytes live at the peak by term (the planner's item names, plus ``other``)."""
    largest: list[Allocation]
    """The largest tensors live at the peak."""
    seconds: float
    memtracker_peak_bytes: int | None = None
    """``MemTracker``'s peak of the same run (``cross_check=True``)."""
    notes: list[str] = field(default_factory=list)
    """Where the rehearsal left the GPU path (e.g. an op CUDA autocast would run in fp32)."""

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


class _CudaCasts(TorchFunctionMode):
    """Where CPU fake tensors would leave the CUDA path: SDPA's boolean mask becomes the additive mask
    (query dtype, or the autocast dtype) the CUDA composite makes before its kernels, and the ops CUDA
    autocast runs in fp32 are noted when they see a low-precision tensor under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "").strip("_")
        if name == "scaled_dot_product_attention":
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, Tensor) and mask.dtype == torch.bool:
                query = args[0]
                on = torch.is_autocast_enabled(query.device.type)
                dtype = torch.get_autocast_dtype(query.device.type) if on else query.dtype
                bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                    ~mask, float("-inf")
                )
                kwargs["attn_mask"] = bias
                args = args[:3] + args[4:] if len(args) > 3 else args
        elif name in CUDA_FP32_OPS and torch.is_autocast_enabled("cpu"):
            low = [a for a in args if isinstance(a, Tensor) and a.dtype in (torch.bfloat16, torch.float16)]
            if low:
                self.notes.add(
                    f"{name} on a {low[0].dtype} tensor under autocast: CUDA autocast runs it in fp32"
                )
        return func(*args, **kwargs)


@contextmanager
def _eager_flex() -> Iterator[None]:
    """flex_attention as its HOP on fake tensors: torch's own debug switch skips Dynamo, and its refusal of
    CPU tensors that need a gradient (no CPU backward kernel) is lifted for fake ones."""
    import torch.nn.attention.flex_attention as fa

    debug, validate = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device

    def validate_real(query: Tensor, key: Tensor, value: Tensor) -> None:
        if not isinstance(query, FakeTensor):
            validate(query, key, value)

    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device = True, validate_real
    try:
        yield
    finally:
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device = debug, validate


@dataclass
class _Session:
    live: LiveBytes
    casts: _CudaCasts
    memtracker: MemTracker | None


@contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks, this process rank 0, whose collectives move nothing
    (torch's ``fake`` backend): FSDP2 shards over it as over the drafters."""
    if dist.is_initialized():
        raise RuntimeError("the rehearsal of a sharded drafter needs a process without a process group")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def fake_session(cuda: bool, cross_check: bool = False, shard_over: int = 1) -> Iterator[_Session]:
    """Fake tensors with small ones real, a :class:`LiveBytes` tracker (and ``MemTracker`` with
    ``cross_check``), with ``cuda`` the GPU paths of the module doc, and with ``shard_over > 1`` a
    fake process group of that many drafters."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    session = _Session(LiveBytes(), _CudaCasts(), MemTracker() if cross_check else None)
    if session.memtracker is not None:  # flex_attention's HOP: its outputs are tracked like an op's
        session.memtracker.supports_higher_order_operators = True
    trackers = [session.live] + ([session.memtracker] if session.memtracker is not None else [])
    with ExitStack() as stack:
        if shard_over > 1:
            stack.enter_context(fake_group(shard_over))
        stack.enter_context(fake)
        stack.enter_context(RealSmall(fake))
        for tracker in trackers:
            stack.enter_context(tracker)
        if cuda:
            stack.enter_context(as_cuda(lambda: uncounted_by(*trackers)))
            stack.enter_context(_eager_flex())
            stack.enter_context(session.casts)
        yield session


def _measure(role: str, session: _Session, t0: float, peak: Peak) -> RoleMeasurement:
    mt = session.memtracker
    mt_peak = None
    if mt is not None:
        mt_peak = int(sum(snap.get("Total", 0) for snap in mt.get_tracker_snapshot("peak").values()))
    return RoleMeasurement(
        role=role,
        peak_bytes=peak.bytes,
        by_term=peak.by_term,
        largest=peak.largest,
        seconds=time.perf_counter() - t0,
        memtracker_peak_bytes=mt_peak,
        notes=sorted(session.casts.notes),
    )


# ----------------------------------------------------------------------------------------------
# The packet and the models


def sample_lengths(tokens: int, num_seqs: int) -> list[int]:
    """``num_seqs`` sample lengths that sum to ``tokens`` (equal up to one token)."""
    base, extra = divmod(tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def packet_tokens(
    inputs: PlanInputs, vocab: int, packet: PacketShape | None = None
) -> tuple[list[Tensor], list[Tensor]]:
    """Token ids and loss masks of one of the planner's packets (default the target's): the last
    ``supervised_fraction`` of each sample supervised (the prompt first), ids drawn below ``vocab``
    from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    ids, masks = [], []
    packet = packet or inputs.packet
    for n in packet.doc_lengths or sample_lengths(packet.tokens, packet.num_seqs):
        ids.append(torch.randint(0, vocab, (n,), generator=g))
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[n - round(inputs.stats.supervised_fraction * n) :] = 1
        masks.append(mask)
    return ids, masks


def received_packet(inputs: PlanInputs, dtype: torch.dtype, packet: PacketShape | None = None) -> Packet:
    """The payload a drafter receives for one of the planner's packets (default the target's: what a
    target holds in flight), in the link's own buffers, filled in."""
    arch, packet = inputs.arch, packet or inputs.packet
    header = Header(
        version=PROTOCOL_VERSION,
        kind=KIND_DATA,
        g=0,
        num_seqs=packet.num_seqs,
        total_tokens=packet.tokens,
        n_tap=arch.num_taps,
        hidden_size=arch.hidden_size,
        dtype=DTYPE_CODES[dtype],
        flags=0,
        forward_us=0,
        peak_mem_bytes=0,
        num_skipped_nonfinite=0,
        num_skipped_oom=0,
        oom_splits=0,
    )
    out = packet_from_payload(header, payload_buffers(header, torch.device("cpu")))
    ids, masks = packet_tokens(inputs, arch.vocab_size - 1, packet)
    out.input_ids.copy_(torch.cat(ids))
    out.loss_mask.copy_(torch.cat(masks))
    out.seq_lens.copy_(torch.tensor([len(x) for x in ids]))
    return out


def target_model(cfg: Config, inputs: PlanInputs, dtype: torch.dtype) -> PreTrainedModel:
    """The target ``*ForCausalLM`` with random weights from its config.json, else from ``target.shape``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = local_config_dir(cfg)
    if directory is not None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=cfg.target.trust_remote_code)
    else:
        config = hf_config(inputs)
    family = family_of(str(config.get_text_config(decoder=True).model_type))
    attn = cfg.target.attn_implementation
    attn = attn if attn in ("sdpa", "eager") else family.rehearsal_attention
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    install_varlen(model)  # what the loader does: packed documents restart the linear-attention state
    return model.eval().requires_grad_(False)


def hf_config(inputs: PlanInputs) -> Any:
    """A transformers config of ``target.shape`` (its family's, ``dflash.targets.families.fake_config``)."""
    from transformers import AutoConfig

    model_type, kwargs = fake_config(inputs.target.meta, max(40960, inputs.packet.tokens))
    return AutoConfig.for_model(model_type, **kwargs)


# ----------------------------------------------------------------------------------------------
# The steps


def make_packet(model: nn.Module, cfg: Config, inputs: PlanInputs, live: LiveBytes) -> tuple[Tensor, Tensor]:
    """The target's packet as the packet maker makes it: forward, padding removed, finite check.

    The model runs SDPA (``target_model``). A document-masked kernel (``inputs.target_attention``
    sparse: flex, flash-attn) holds no [T, T] mask: it stands in as SDPA over the packed row taken as
    one causal document (``is_causal``, the same tensors; the cross-document pairs it computes are
    FLOPs, not memory). A linear-attention layer's delta rule runs once over the row
    (:func:`whole_row_delta_rule`), as the varlen CUDA kernel does: the torch fallback's working set,
    the bound the planner counts."""
    ids, _ = packet_tokens(inputs, inputs.arch.vocab_size - 1)
    batch, attention_mask, positions, keep = build_batch(ids, pack=cfg.target.pack, pad_id=0)
    lens = [len(x) for x in ids]
    if cfg.target.pack and inputs.target_attention == "sparse":
        lens = [sum(lens)]
    with live.term("activations"), whole_row_delta_rule():
        aux, final = target_forward(
            model, batch, attention_mask, inputs.arch.target_layer_ids, positions, seq_lens=lens
        )
    with live.term("packets"):
        aux, final = gather_tokens(aux, keep), gather_tokens(final, keep)
    with live.term("activations"):
        (torch.isfinite(aux).all(dim=1) & torch.isfinite(final).all(dim=1)).cpu()
    return aux, final


@dataclass
class DrafterState:
    """What a drafter rank holds between steps."""

    model: DFlashDraftModel
    optimizer: torch.optim.Optimizer
    embed: Tensor
    head: Tensor


def build_drafter(
    cfg: Config,
    inputs: PlanInputs,
    live: LiveBytes,
    settings: DrafterSettings,
    *,
    embed_head: tuple[Tensor, Tensor] | None = None,
    weights_term: str = "weights",
) -> DrafterState:
    """The drafter model (fp32; sharded over the fake group with ``settings.shard``), its AdamW
    (foreach, as on CUDA) and the frozen embedding and lm_head (``embed_head``: the co-located
    target's own; else a copy in the target dtype)."""
    with live.term(weights_term):
        model = new_drafter(inputs.arch)
        if settings.shard != "none" and settings.num_drafters > 1:
            shard_drafter(model, drafter_mesh(dist.group.WORLD, torch.device("cpu")), settings.shard)
    model.checkpoint_layers = settings.checkpoint
    optimizer = build_optimizer(list(model.parameters()), cfg.optim, model.lookup_tables())
    for group in optimizer.param_groups:
        if "foreach" in group:  # AdamW's (Muon has no foreach implementation)
            group["foreach"] = True
    if embed_head is None:
        dtype = torch_dtype(cfg.target.dtype, torch.device(plan_device(cfg)))
        shape = (inputs.arch.vocab_size, inputs.arch.hidden_size)
        with live.term("embed_and_head"):
            embed_head = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
    return DrafterState(model, optimizer, *embed_head)


def drafter_step(
    state: DrafterState, packet: Packet, cfg: Config, live: LiveBytes, block_chunks: int = 1
) -> None:
    """One optimizer step on one packet as the trainer runs it (``dflash.drafter.step``: anchors, the
    loss under autocast, its blocks in ``block_chunks`` chunks, a sharded model's chunks before the
    last without gradient sync and a replicated one's empty chunks skipped), then backward, the
    gradient scale, the clip and the AdamW step."""
    sharded = is_sharded(state.model)
    plan = StepPlan.for_training(
        cfg,
        state.model.block_size,
        device=plan_device(cfg),
        token_budget=cfg.data.token_budget,
        tensors_on="cpu",
        block_chunks=block_chunks,
        skip_empty_chunks=not sharded,
    )
    anchors = plan_anchors(plan, packet.seq_lens, packet.loss_mask, 0)
    state.optimizer.zero_grad(set_to_none=False)
    with live.term("activations"):
        out = objective_step(
            state.model,
            state.embed,
            state.head,
            packet.aux_hidden,
            packet.final_hidden,
            packet.input_ids,
            packet.loss_mask,
            anchors,
            plan,
            on_phase=lambda phase: live.set_term(PHASE_TERMS[phase]),
            partial_backward=partial(unsynced_backward, state.model) if sharded else None,
        )
    params = list(state.model.parameters())
    with live.term("backward"):
        out.loss.backward()
    del out
    grads = [p.grad for p in params if p.grad is not None]
    with live.term("optimizer"):
        for g in grads:
            g.mul_(1.0)  # the trainer's 1 / global weight sum, in place
        clip_grad_norm_(params, cfg.optim.max_grad_norm)
        state.optimizer.step()


def prime(state: DrafterState, live: LiveBytes) -> None:
    """The state a drafter holds from its second step on: gradients (kept between steps, zeroed in
    place) and the optimizer's state (AdamW's moments, Muon's momentum: made by its first step; here by
    a step on zero gradients)."""
    params = list(state.model.parameters())
    with live.term("gradients"):
        for p in params:
            p.grad = torch.zeros_like(p)
    with live.term("optimizer_state"):
        state.optimizer.step()


def rehearse_target(cfg: Config, inputs: PlanInputs, *, top: int = 10) -> RoleMeasurement:
    """A target rank: its weights, ``max_in_flight`` packets in flight and the forward of the next one."""
    t0 = time.perf_counter()
    device = torch.device(plan_device(cfg))
    dtype = torch_dtype(cfg.target.dtype, device)
    with fake_session(device.type == "cuda") as s:
        with s.live.term("weights"):
            model = target_model(cfg, inputs, dtype)
        with s.live.term("packets"):
            in_flight = [received_packet(inputs, dtype) for _ in range(cfg.topology.max_in_flight)]
        make_packet(model, cfg, inputs, s.live)
        del in_flight
        return _measure("target", s, t0, s.live.peak(top))


def rehearse_drafter(
    cfg: Config,
    inputs: PlanInputs,
    *,
    settings: DrafterSettings = PLAIN,
    cross_check: bool = False,
    top: int = 10,
    anchor_caps: Sequence[int] | None = None,
) -> dict[int | None, RoleMeasurement]:
    """A drafter rank in its steady state (:func:`prime`): one step on a received packet per anchor cap
    (``anchor_caps``, default the config's ``drafter.max_anchors_per_packet``), each from the same state.
    ``cross_check`` (one cap): ``MemTracker`` follows the same run (it hooks the gradient of every
    module parameter, so it cannot follow the roles with a frozen target)."""
    t0 = time.perf_counter()
    caps = list(anchor_caps) if anchor_caps is not None else [cfg.drafter.max_anchors_per_packet]
    if cross_check and len(caps) > 1:
        raise ValueError("cross_check follows one step: give one anchor cap")
    device = torch.device(plan_device(cfg))
    dtype = torch_dtype(cfg.target.dtype, device)
    out: dict[int | None, RoleMeasurement] = {}
    with fake_session(device.type == "cuda", cross_check, settings.num_drafters) as s:
        state = build_drafter(cfg, inputs, s.live, settings)
        prime(state, s.live)
        with s.live.term("packets"):
            packet = received_packet(inputs, dtype, inputs.packets.drafter)
        for cap in caps:
            s.live.reset_peak()
            drafter_step(state, packet, _capped(cfg, inputs, cap), s.live, settings.block_chunks)
            out[cap] = _measure("drafter", s, t0, s.live.peak(top))
    return out


def _capped(cfg: Config, inputs: PlanInputs, cap: int | None) -> Config:
    return (
        cfg
        if cap is None or cap == cfg.drafter.max_anchors_per_packet
        else with_anchor_cap(cfg, inputs, cap)[0]
    )


def rehearse_colocated(
    cfg: Config,
    inputs: PlanInputs,
    *,
    settings: DrafterSettings = PLAIN,
    top: int = 10,
    anchor_caps: Sequence[int] | None = None,
) -> dict[int | None, RoleMeasurement]:
    """A co-located rank: the target and a drafter on its embedding and lm_head; the target's packet,
    then the drafter step on it per anchor cap (as :func:`rehearse_drafter`): a cap's peak is the
    larger of the forward's and its step's. Where the packet of the most trained anchors is not the
    target's (padded rows), the forward runs the target's and the step the drafter's, each the worst
    for its part (the forward's packet is dropped before the step)."""
    t0 = time.perf_counter()
    caps = list(anchor_caps) if anchor_caps is not None else [cfg.drafter.max_anchors_per_packet]
    device = torch.device(plan_device(cfg))
    dtype = torch_dtype(cfg.target.dtype, device)
    out: dict[int | None, RoleMeasurement] = {}
    with fake_session(device.type == "cuda", shard_over=settings.num_drafters) as s:
        with s.live.term("target_weights"):
            target = target_model(cfg, inputs, dtype)
        embed, head = target_embed_and_head(target)
        assert embed is not None and head is not None, "the target exposes no embedding / lm_head"
        state = build_drafter(
            cfg, inputs, s.live, settings, embed_head=(embed, head), weights_term="drafter_weights"
        )
        prime(state, s.live)
        ids, masks = packet_tokens(inputs, inputs.arch.vocab_size - 1)
        s.live.reset_peak()
        aux, final = make_packet(target, cfg, inputs, s.live)
        forward = s.live.peak(top)
        if inputs.packets.drafter is not inputs.packet:
            del aux, final
            ids, masks = packet_tokens(inputs, inputs.arch.vocab_size - 1, inputs.packets.drafter)
            with s.live.term("packets"):
                tokens, h = sum(len(x) for x in ids), inputs.arch.hidden_size
                aux = torch.empty(tokens, inputs.arch.num_taps * h, dtype=dtype)
                final = torch.empty(tokens, h, dtype=dtype)
        packet = Packet(
            index=0,
            input_ids=torch.cat(ids),
            loss_mask=torch.cat(masks),
            seq_lens=torch.tensor([len(x) for x in ids]),
            sample_ids=torch.arange(len(ids)),
            aux_hidden=aux,
            final_hidden=final,
        )
        del aux, final
        for cap in caps:
            s.live.reset_peak()
            drafter_step(state, packet, _capped(cfg, inputs, cap), s.live, settings.block_chunks)
            step = s.live.peak(top)
            out[cap] = _measure("colocated", s, t0, forward if forward.bytes > step.bytes else step)
    return out


ITEM_OF_TERM = {
    "drafter": {"backward": "activations"},
    "colocated": {
        "backward": "activations_peak",
        "activations": "activations_peak",
        "loss_workspace": "activations_peak",
    },
}
"""The planner's item that a rehearsal term is part of, where the names differ."""


def measured_items(role: str, by_term: dict[str, int]) -> dict[str, float]:
    """GiB live at the peak by the planner's item names of ``role`` (plus ``other``)."""
    out: dict[str, float] = {}
    for term, nbytes in by_term.items():
        item = ITEM_OF_TERM.get(role, {}).get(term, term)
        out[item] = out.get(item, 0.0) + nbytes / GIB
    return out


def rehearse(
    cfg: Config,
    inputs: PlanInputs,
    roles: Sequence[str] = ROLES,
    *,
    settings: DrafterSettings = PLAIN,
    anchor_caps: Sequence[int] | None = None,
) -> dict[tuple[str, int | None], RoleMeasurement]:
    """Each of ``roles`` rehearsed, ``(role, cap)`` -> its measurement; the target once (cap None), the
    drafter roles per anchor cap (default the config's) with the drafter's memory levers ``settings``."""
    out: dict[tuple[str, int | None], RoleMeasurement] = {}
    for role in roles:
        if role == "target":
            out[role, None] = rehearse_target(cfg, inputs)
            continue
        fn = rehearse_drafter if role == "drafter" else rehearse_colocated
        for cap, m in fn(cfg, inputs, settings=settings, anchor_caps=anchor_caps).items():
            out[role, cap] = m
    return out
