"""The DFlash draft model: architecture only (no distributed code, no optimizer, no loss).

Shape legend: B batch rows, S context tokens, Q query (block) tokens = N blocks x block_size,
H hidden size, n_tap tapped target layers, nh / nkv query / key-value heads, hd head dim.

A stack of Qwen3-style decoder layers as wide as the target with "KV injection": queries come from
the block tokens only, keys and values from ``[context; block]`` where
``context = hidden_norm(fc(concat of the tapped target hidden states))`` is computed once and shared
by every layer (the context rows are never updated across layers). q/k RMSNorm, the target's RoPE,
GQA, no biases, an own final norm. Embedding and lm_head are the target's, frozen, and live outside
this module. Parameter names follow the public DFlash checkpoint layout
(``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``).
Each layer is ``full_attention`` or ``sliding_attention`` (window W): what a block query sees in
either is written down, with the servers it follows, in ``dflash.drafter.blocks``.

Under autocast (bf16 on GPU) every activation that feeds GEMMs is cast once, by :func:`gemm_input`,
for the whole group of GEMMs that read it (left to autocast, each GEMM would make and save its own
copy): the normed block states once for q, k and v, the MLP input once for gate and up, the context
once for the k and v of every layer; the tapped target states go to ``fc`` in their own dtype (no
fp32 round trip), and q and k enter attention in v's dtype. Per layer that leaves the seven weight
casts (cached by autocast), the two inputs, q and k, and the bf16 rounding inside the q/k RMSNorms
(``tests/unit/test_drafter_compute.py`` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.drafter.arch import DrafterArch
from dflash.drafter.attention import AttentionMask, attend
from dflash.drafter.blocks import decode_mask


def autocast_on(device_type: str) -> bool:
    """Autocast is on for ``device_type`` (never for a device without autocast, e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def gemm_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype autocast runs GEMMs in when autocast is on for its device (one copy that
    every GEMM reading ``x`` then shares), else ``x`` itself. fp64 is left alone, as autocast does."""
    kind = x.device.type
    if not autocast_on(kind) or x.dtype == torch.float64:
        return x
    return x.to(torch.get_autocast_dtype(kind))


class RotaryEmbedding(nn.Module):
    """The target's RoPE (same theta and scaling), with optional partial rotary dims."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        cfg = arch.qwen3_config()
        self.rotary_dim = int(arch.head_dim * arch.partial_rotary_factor)
        cfg.head_dim = self.rotary_dim
        self.inner = Qwen3RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, L] -> cos, sin [B, L, rotary_dim] in x's dtype."""
        return self.inner(x, position_ids)


ContextKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's context keys and values [B, nkv, S, hd] (:meth:`DFlashAttention.context_kv`)."""


ROPE_IS_NEOX_STYLE = True
"""The drafter rotates the two halves of each head (GPT-NeoX layout, :func:`_rotate_half`), never
interleaved pairs, whatever the target does: exports write it as ``is_neox_style``, which vLLM
reads from the drafter's own config (default true; vllm-project/vllm#54373: the layout the drafter
was trained under must hold, not the target's)."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, hd]; cos/sin [B, L, rd] rotate the first rd dims (rd == hd unless partial)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class KVCache:
    """Per-layer context keys/values (after k_norm and RoPE) of the accepted tokens, for decoding.

    Only context rows are cached; block rows are never stored, which is the same as cropping the
    cache back after every draft call. A sliding layer keeps only its last W-1 rows (all a block
    after them can see); ``length`` counts every context position fed so far.
    """

    def __init__(self, num_layers: int, keep: list[int | None] | None = None) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.keep = list(keep) if keep is not None else [None] * num_layers
        self.fed = [0] * num_layers

    @property
    def length(self) -> int:
        return self.fed[0]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append context rows [B, nkv, L, hd] to layer ``layer``; returns the rows it keeps."""
        self.fed[layer] += k.shape[2]
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        keep = self.keep[layer]
        if keep is not None and k.shape[2] > keep:
            k, v = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        self.keys[layer], self.values[layer] = k, v
        return k, v


class DFlashAttention(nn.Module):
    def __init__(self, arch: DrafterArch, window: int | None) -> None:
        super().__init__()
        h, hd = arch.hidden_size, arch.head_dim
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.q_proj = nn.Linear(h, arch.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(arch.num_heads * hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=arch.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=arch.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def context_kv(self, context: torch.Tensor, rope_ctx: tuple[torch.Tensor, torch.Tensor]) -> ContextKV:
        """context [B, S, H] -> the context's keys and values [B, nkv, S, hd] (keys after k_norm and
        RoPE, in fp32 under autocast: attention casts them with the block's keys, in one copy)."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), *rope_ctx)
        return k, self._heads(self.v_proj(context), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | ContextKV,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_ctx: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """x [B, Q, H] normed block states, context [B, S, H] (or its :meth:`context_kv`, computed
        once for several calls: ``rope_ctx`` is then unused) -> [B, Q, H].

        Keys/values are ``[cached context; context; block]``; ``mask`` is None only for decoding one
        block that follows all of that context: a full layer then sees everything, a sliding layer
        its window (``decode_mask``).
        """
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), *rope_q)
        if isinstance(context, torch.Tensor):
            assert rope_ctx is not None
            context = self.context_kv(context, rope_ctx)
        k_ctx, v_ctx = context
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *rope_q)
        v_blk = self._heads(self.v_proj(x), self.num_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        # q and k leave the RMSNorm (fp32 weight) and RoPE in fp32; attention takes v's dtype for all three
        q, k = q.to(v.dtype), k.to(v.dtype)
        if mask is None and self.window is not None and x.shape[1] > 0:
            mask = decode_mask(k_ctx.shape[2], x.shape[1], self.window, x.device)
        out = attend(q, k, v, mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(
            out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.num_heads * self.head_dim)
        )


class DFlashDecoderLayer(nn.Module):
    def __init__(self, arch: DrafterArch, layer: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.self_attn = DFlashAttention(arch, arch.window(layer))
        self.post_attention_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.mlp = Qwen3MLP(arch.qwen3_config())
        self.compiled: Callable[..., torch.Tensor] | None = None
        """The ``torch.compile``d training forward (:meth:`DFlashDraftModel.compile_layers`), or None."""

    def context_kv(self, context: torch.Tensor, rope_ctx: tuple[torch.Tensor, torch.Tensor]) -> ContextKV:
        """This layer's context keys and values (:meth:`DFlashAttention.context_kv`), as a module
        method FSDP2 gathers the layer's weights around (``register_fsdp_forward_method``). The values
        are made contiguous: FSDP2 warns about every view a wrapped module returns."""
        k, v = self.self_attn.context_kv(context, rope_ctx)
        return k, v.contiguous()

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | ContextKV, rope_q, rope_ctx, mask, cache, layer
    ) -> torch.Tensor:
        """x [B, Q, H] fp32 residual stream, context [B, S, H] (already :func:`gemm_input`), or this
        layer's :meth:`context_kv` computed once for several calls -> [B, Q, H].

        A training forward (no cache) runs :attr:`compiled` when there is one; decoding stays eager."""
        if cache is None and self.compiled is not None:
            return self.compiled(x, context, rope_q, rope_ctx, mask)
        return self.body(x, context, rope_q, rope_ctx, mask, cache, layer)

    def body(
        self,
        x: torch.Tensor,
        context: torch.Tensor | ContextKV,
        rope_q,
        rope_ctx,
        mask,
        cache=None,
        layer: int = 0,
    ) -> torch.Tensor:
        """The layer's math (:meth:`forward`, eager)."""
        h = gemm_input(self.input_layernorm(x))  # one copy for q, k and v
        x = x + self.self_attn(h, context, rope_q, rope_ctx, mask, cache, layer)
        return x + self.mlp(gemm_input(self.post_attention_layernorm(x)))  # one copy for gate and up


class DFlashDraftModel(nn.Module):
    """Block-diffusion drafter conditioned on tapped target hidden states."""

    checkpoint_layers: bool = False
    """Per-layer activation checkpointing (``drafter.activation_checkpointing``; set it on the instance): in
    training each layer keeps only its inputs and runs its forward again in backward (non-reentrant
    ``torch.utils.checkpoint``); the results are the same."""

    layer_class: type[DFlashDecoderLayer] = DFlashDecoderLayer
    """The decoder layer a family builds (DFlash2 wraps its sublayers in convolutions)."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList(self.layer_class(arch, i) for i in range(arch.num_layers))
        self.fc = nn.Linear(arch.num_taps * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.norm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch)
        self.add_family_modules()
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.arch.block_size

    def compile_layers(self, dynamic: bool | None = False) -> None:
        """``torch.compile`` each decoder layer's training forward on its own (as torchtitan compiles
        each transformer block): one graph per layer fuses its norms, RoPE, SiLU gate and residual adds
        around the GEMMs and attention (flex is compiled inside it). ``dynamic=False``: one graph per
        shape, for the static flex shapes; None lets torch mark a changing size dynamic (dense SDPA,
        whose shapes follow each packet). Decoding with a cache stays eager.

        What is compiled is each layer's math inside its module call, so parameter names do not
        change (checkpoints and the export are untouched) and everything wrapped around the call
        stays eager and composes: :attr:`checkpoint_layers` checkpoints the call (backward runs the
        compiled forward again), and FSDP2's ``fully_shard`` of a layer (applied after this) gathers
        and frees its weights in the module's hooks, outside the graph."""
        for layer in self.layers:
            assert isinstance(layer, DFlashDecoderLayer)
            layer.compiled = torch.compile(layer.body, dynamic=dynamic)

    def new_cache(self) -> KVCache:
        """An empty decoding cache: sliding layers keep their last W-1 context rows."""
        windows = [self.arch.window(i) for i in range(self.arch.num_layers)]
        return KVCache(self.arch.num_layers, [None if w is None else w - 1 for w in windows])

    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) linears, unit norms (HF ``post_init`` convention), then the
        family's own modules (:meth:`reset_family_parameters`; the DFlash-1 modules draw the same
        numbers whatever the family adds)."""
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        own = {id(sub) for module in self.family_modules() for sub in module.modules()}
        for module in self.modules():
            if id(module) in own:
                continue
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    w = torch.randn(module.weight.shape, generator=gen) * self.arch.initializer_range
                    module.weight.copy_(w)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        self.reset_family_parameters(gen)

    def add_family_modules(self) -> None:
        """A family's modules beyond DFlash-1's (built before the initialisation; DFlash-1 has none)."""

    def family_modules(self) -> list[nn.Module]:
        """The modules :meth:`reset_family_parameters` initialises (the common one skips them)."""
        return []

    def reset_family_parameters(self, gen: torch.Generator | None) -> None:
        """A family's own initialisation after the common one (DFlash-1 has none)."""

    def lookup_tables(self) -> list[nn.Parameter]:
        """Trainable tables indexed by token id (embedding-like: rows, not a linear map), which
        ``optim=muon`` leaves to AdamW as it does the norms (DFlash-1 has none)."""
        return []

    def propose(self, hidden: torch.Tensor, previous: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The decode hook: greedy draft tokens [B, L] of the block slots after the anchor.

        hidden [B, L, H] final hidden states of slots 1..L; previous [B] the anchor token; head
        [V, H] the target's lm_head. DFlash-1: the argmax of each slot's logits."""
        return (hidden @ head.T).argmax(-1)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, n_tap*H] concatenated tapped target states -> [B, S, H] context rows, ready for the
        layers' k and v projections (:func:`gemm_input`: one copy shared by every layer).

        The taps go to ``fc`` as they come when autocast is on (bf16 from the target: no copy at
        all), else in ``fc``'s dtype."""
        on = autocast_on(target_hidden.device.type) and target_hidden.dtype != torch.float64
        taps = target_hidden if on else target_hidden.to(self.fc.weight.dtype)
        return gemm_input(self.hidden_norm(self.fc(gemm_input(taps))))

    def context_states(self, target_hidden: torch.Tensor, context_positions: torch.Tensor) -> list[ContextKV]:
        """Every layer's context keys and values from the tapped target states [B, S, n_tap*H] at
        RoPE positions [B, S]: what the blocks of a packet share, computed once for all of its
        chunks of blocks (``forward(context_kv=...)``); differentiable."""
        context = self.context(target_hidden)
        rope_ctx = self.rotary_emb(context.new_empty(0, dtype=self.fc.weight.dtype), context_positions)
        layers: list[DFlashDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        return [layer.context_kv(context, rope_ctx) for layer in layers]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        target_hidden: torch.Tensor | None,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        masks: Mapping[str, AttentionMask] | None,
        cache: KVCache | None = None,
        context_kv: list[ContextKV] | None = None,
    ) -> torch.Tensor:
        """Drafter final hidden states of the block slots.

        noise_embeds [B, Q, H]: target embedding of ``[x_anchor, MASK x (bs-1)]`` per block;
        target_hidden [B, S, n_tap*H] (S may be 0 when decoding with a warm cache);
        context_positions [B, S] and block_positions [B, Q] are RoPE positions;
        masks: the training mask of each attention kind in ``arch.layer_types`` over keys
        ``[context (S); blocks (Q)]`` (``blocks.build_masks``), or None for decoding one block right
        after the context (and ``cache``). ``context_kv``: the layers' :meth:`context_states` of
        the context, computed once for several calls (``target_hidden`` is then unused). Returns
        [B, Q, H] after the drafter's final norm.
        """
        x = noise_embeds.to(self.fc.weight.dtype)
        rope_q = self.rotary_emb(x, block_positions)
        contexts: list[torch.Tensor] | list[ContextKV]
        rope_ctx = None
        if context_kv is None:
            assert target_hidden is not None
            contexts = [self.context(target_hidden)] * len(self.layers)
            rope_ctx = self.rotary_emb(x, context_positions)
        else:
            contexts = context_kv
        recompute = self.checkpoint_layers and torch.is_grad_enabled() and cache is None
        for i, (layer, context) in enumerate(zip(self.layers, contexts, strict=True)):
            mask = None if masks is None else masks[self.arch.layer_types[i]]
            if recompute:
                x = checkpoint(layer, x, context, rope_q, rope_ctx, mask, cache, i, use_reentrant=False)
            else:
                x = layer(x, context, rope_q, rope_ctx, mask, cache, i)
        return self.norm(x)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
