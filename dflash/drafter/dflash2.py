"""DFlash2: the DFlash drafter plus block-local dynamic convolutions and a candidate selector.

Shape legend as in :mod:`dflash.drafter.model`; G conv groups (H / conv_group_size), K conv taps
(``conv_kernel_size``), r selector rank, k candidates (``selector_top_k``).

Each decoder layer wraps its attention and its MLP in a :class:`BlockConv` (``attention_conv``,
``mlp_conv``). From the sublayer's normed input ``u`` it computes per-slot coefficients
``c = kernel_projection(u)`` ``[.., 2, K, G]`` (one per side, tap and channel group); the sublayer
then reads ``conv_0(u)`` and its output ``y`` becomes ``conv_1(y)`` before the residual add, where

    conv_s(x)[t, ch] = sum_{o < K} (base_kernel[s, o, ch] + c[t, s, o, group(ch)]) * x[t - o, ch]

over the slots of the same block only (``x[t - o]`` is 0 before the block's slot 0): a block never
reads another block, in training (N blocks side by side) as in decoding (one block). This is the
public z-lab/dflash reference's ``GroupedDynamicCausalConv`` (where decoding feeds one block at a
time) made block-local for training. Identity initialisation (``base_kernel[:, 0] = 1``, every other
tap and the projection 0) gives exactly the DFlash-1 layer.

After the final norm a :class:`CandidateSelector` re-ranks the top-k of each slot's logits
(``unary``): candidate ``c`` after predecessor token ``p`` scores
``unary[c] + sum_r predecessor_codebook[p, r] * hidden_projection(h)[r] * successor_codebook[c, r]``,
and decoding walks one chain per block (slot 1's predecessor is the anchor token, each later slot's
the previous pick): still one drafter forward per block and ordinary chain verification. The
hidden projection starts at 0, so the edge scores start at exactly 0 and the selector picks the
argmax, as DFlash-1 does; the codebooks start N(0, 1), so the projection's first gradient is not 0.

Tensor names are the served layout: ``layers.{i}.{attention,mlp}_conv.base_kernel`` ``[2, K, H]``,
``...kernel_projection.weight`` ``[2*K*G, H]`` (coefficients ordered side, tap, group),
``candidate_selector.{predecessor,successor}_codebook`` ``[V, r]`` (parameters, no ``.weight``) and
``candidate_selector.hidden_projection.weight`` ``[r, H]``.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.drafter.arch import DrafterArch
from dflash.drafter.model import ContextKV, DFlashDecoderLayer, DFlashDraftModel, gemm_input


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class BlockConv(nn.Module):
    """The two dynamic depthwise convolutions around one sublayer (side 0 before, side 1 after)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_identity(self) -> None:
        """Tap 0 = 1, every other tap and the projection 0: both convolutions are the identity."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, Q, H] normed sublayer input (already :func:`gemm_input`) -> [B, Q, 2, K, G]."""
        return self.kernel_projection(u).view(*u.shape[:-1], 2, self.kernel_size, self.groups)

    def forward(self, x: torch.Tensor, coef: torch.Tensor, side: int, segment: int) -> torch.Tensor:
        """conv_side(x): x [B, Q, H] with Q a multiple of ``segment`` (the block length); coef from
        :meth:`coefficients`. Computed in fp32 at least (x and coef may be bf16 under autocast)."""
        B, Q, H = x.shape
        n = Q // segment
        dt = _at_least_fp32(x.dtype)
        xs = x.to(dt).view(B, n, segment, self.groups, self.group_size)
        c = coef[:, :, side].to(dt).view(B, n, segment, self.kernel_size, self.groups, 1)
        base = self.base_kernel[side].to(dt).view(self.kernel_size, self.groups, self.group_size)
        out = torch.zeros_like(xs)
        for o in range(min(self.kernel_size, segment)):
            shifted = xs if o == 0 else nn.functional.pad(xs[:, :, :-o], (0, 0, 0, 0, o, 0))
            out = out + (base[o] + c[:, :, :, o]) * shifted
        return out.view(B, Q, H)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP each sit between two block-local convolutions."""

    def __init__(self, arch: DrafterArch, layer: int) -> None:
        super().__init__(arch, layer)
        self.block_size = arch.block_size
        self.attention_conv = BlockConv(arch.hidden_size, arch.conv_kernel_size, arch.conv_group_size)
        self.mlp_conv = BlockConv(arch.hidden_size, arch.conv_kernel_size, arch.conv_group_size)

    def convs(self) -> tuple[BlockConv, BlockConv]:
        return self.attention_conv, self.mlp_conv

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
        """As DFlash-1's, each sublayer between its convolutions. ``mask`` is None exactly when one
        block is decoded: the block is then all of x, else blocks of ``block_size`` follow each other."""
        segment = x.shape[1] if mask is None else self.block_size
        h = gemm_input(self.input_layernorm(x))
        coef = self.attention_conv.coefficients(h)
        h = gemm_input(self.attention_conv(h, coef, 0, segment))
        a = self.self_attn(h, context, rope_q, rope_ctx, mask, cache, layer)
        x = x + self.attention_conv(a, coef, 1, segment)
        h = gemm_input(self.post_attention_layernorm(x))
        coef = self.mlp_conv.coefficients(h)
        m = self.mlp(gemm_input(self.mlp_conv(h, coef, 0, segment)))
        return x + self.mlp_conv(m, coef, 1, segment)


class CandidateSelector(nn.Module):
    """Low-rank edge scores between a predecessor token and each candidate, given the slot's hidden."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        v, r = arch.vocab_size, arch.selector_rank
        self.top_k = arch.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(v, r))
        self.successor_codebook = nn.Parameter(torch.empty(v, r))
        self.hidden_projection = nn.Linear(arch.hidden_size, r, bias=False)

    def reset(self, gen: torch.Generator | None) -> None:
        """N(0, 1) codebooks, a zero projection: every edge score starts at exactly 0."""
        with torch.no_grad():
            for book in (self.predecessor_codebook, self.successor_codebook):
                book.copy_(torch.randn(book.shape, generator=gen))
            self.hidden_projection.weight.zero_()

    def edges(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], previous [...] token ids, candidates [..., k] ids -> scores [..., k] (fp32 or fp64)."""
        dt = _at_least_fp32(hidden.dtype)
        query = self.hidden_projection(gemm_input(hidden)).to(dt) * self.predecessor_codebook[previous].to(dt)
        keys = self.successor_codebook[candidates].to(dt)
        return torch.einsum("...r,...kr->...k", query, keys)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The greedy chain of one block per row: hidden [B, L, H] and logits [B, L, V] of slots
        1..L, first [B] the anchor token -> tokens [B, L] (each slot's best candidate after the
        previous pick)."""
        unary, candidates = logits.to(_at_least_fp32(logits.dtype)).topk(self.top_k, dim=-1)
        picks, previous = [], first
        for t in range(hidden.shape[1]):
            scores = unary[:, t] + self.edges(hidden[:, t], previous, candidates[:, t])
            previous = candidates[:, t].gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            picks.append(previous)
        return torch.stack(picks, dim=1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: :class:`DFlash2DecoderLayer` layers and a :class:`CandidateSelector` after the norm."""

    layer_class = DFlash2DecoderLayer

    candidate_selector: CandidateSelector

    def add_family_modules(self) -> None:
        self.candidate_selector = CandidateSelector(self.arch)

    def convolutions(self) -> list[BlockConv]:
        return [
            conv for layer in self.layers if isinstance(layer, DFlash2DecoderLayer) for conv in layer.convs()
        ]

    def family_modules(self) -> list[nn.Module]:
        return [*self.convolutions(), self.candidate_selector]

    def reset_family_parameters(self, gen: torch.Generator | None) -> None:
        for conv in self.convolutions():
            conv.reset_identity()
        self.candidate_selector.reset(gen)

    def lookup_tables(self) -> list[nn.Parameter]:
        selector = self.candidate_selector
        return [selector.predecessor_codebook, selector.successor_codebook]

    def propose(self, hidden: torch.Tensor, previous: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The selector chain over the slots' top-k (see :meth:`CandidateSelector.walk`)."""
        return self.candidate_selector.walk(hidden, hidden @ head.T, previous)
