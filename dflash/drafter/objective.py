"""The DFlash training objective for one batch, callable on its own with explicit anchors.

``dflash_loss`` is exactly what the trainer runs for every packet, so a step can be reproduced
and compared with other DFlash implementations on identical inputs. Shape legend: B rows, S
tokens per row, N blocks per row, bs block size, R supervised rows (slots with weight > 0), H hidden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.config import LossConfig
from dflash.drafter.blocks import build_masks, label_slots, make_blocks
from dflash.drafter.model import ContextKV, DFlashDraftModel
from dflash.loss.dpace import dpace_weights
from dflash.loss.selector import SelectorOutput, selector_loss
from dflash.loss.terms import TERMS, coefficients, needs_verifier_logits
from dflash.loss.verifier import default_chunk_size, verifier_loss
from dflash.targets.packing import doc_ids_from_positions


@dataclass
class ObjectiveOutput:
    """loss: sum_r w_r*l_r / normalizer (default sum_r w_r) for this batch (differentiable; 0 if
    nothing is supervised).

    Sums for aggregation over micro-batches and ranks (no grad, float64 on CPU unless noted):
    weight_sum (sum_r w_r: the loss's normaliser; with D-PACE the sum of its weights, or of the base
    weights with ``dpace_normalizer=count``), base_weight_sum (sum of the base weights: the decay, or
    1 per slot with D-PACE; the terms' means divide by it), loss_sum (sum_r w_r*l_r), slot_count / slot_hit / slot_hit_verifier
    [bs] (supervised slots and argmax hits per slot, no decay), tau_sum / tau_verifier_sum (sum over
    real blocks of tau_b = 1 + the length of the leading run of hit slots, against the data / the
    verifier argmax), inv_tau_sum / inv_tau_verifier_sum (sum of 1 / tau_b), num_blocks, term_sums
    [len(TERMS)] (weighted sums of each term of ``dflash.loss.terms.TERMS``; 0 for one that was not
    computed).

    Serving tau is a mean over decode steps, and a step at an easy position covers many positions
    while hard stretches take a step per token; blocks here sit at uniform positions. So the
    harmonic mean num_blocks / inv_tau_sum estimates serving tau; the arithmetic mean
    tau_sum / num_blocks (Domino's accept_len) overestimates it whenever acceptance varies.
    """

    loss: torch.Tensor
    weight_sum: torch.Tensor
    base_weight_sum: torch.Tensor
    loss_sum: torch.Tensor
    slot_count: torch.Tensor
    slot_hit: torch.Tensor
    slot_hit_verifier: torch.Tensor
    tau_sum: torch.Tensor
    tau_verifier_sum: torch.Tensor
    inv_tau_sum: torch.Tensor
    inv_tau_verifier_sum: torch.Tensor
    num_blocks: torch.Tensor
    term_sums: torch.Tensor
    num_rows: int
    selector_sums: torch.Tensor
    """[len(SELECTOR_SUMS)]: DFlash2's selector sums (:data:`SELECTOR_SUMS`; zeros for DFlash-1)."""


def sum_outputs(outs: list[ObjectiveOutput], loss: torch.Tensor) -> ObjectiveOutput:
    """The objective of a batch from its parts' (chunks of its blocks, each with the batch's
    normaliser): every sum added; ``loss`` the last part's (differentiable), the others' values
    added to it."""
    names = [f.name for f in dataclasses.fields(ObjectiveOutput) if f.name != "loss"]
    fields = {name: sum(getattr(o, name) for o in outs) for name in names}
    fields["loss"] = sum((o.loss.detach() for o in outs[:-1]), start=torch.zeros_like(loss)) + loss
    return ObjectiveOutput(**fields)


SELECTOR_SUMS = ("rows", "recall", "hit", "weight", "loss", "inv_tau_unary")
"""DFlash2 selector sums per batch: supervised rows, rows whose label is among the top-k
(recall@k), teacher-forced hits (accuracy), the selector loss's weight and weighted loss sums, and
the sum over blocks of 1 / tau of the unary argmax against the verifier (the DFlash-1 decode of the
same logits, beside ``tau_hat``, which for DFlash2 is the selector chain's)."""


def slot_weights(
    block_size: int, gamma: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[bs] exp(-(k-1)/gamma) for k >= 1, 0 for the given slot k = 0."""
    k = torch.arange(block_size, device=device, dtype=dtype)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def prefix_accept(hits: torch.Tensor) -> torch.Tensor:
    """[..., bs] slot hits (slot 0 ignored) -> [...] 1 + length of the leading run of hits."""
    return 1 + torch.cumprod(hits[..., 1:].long(), dim=-1).sum(-1)


def supervised_slots(
    label_pos: torch.Tensor, label_valid: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """[B, N, bs] bool: the slots ``dflash_loss`` supervises (a valid label slot on a loss-mask token)."""
    B, N, bs = label_pos.shape
    return label_valid & loss_mask.gather(1, label_pos.view(B, N * bs)).view(B, N, bs).bool()


def supervised_positions(
    loss_mask: torch.Tensor, doc_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[R] int64, sorted: for each supervised row of ``dflash_loss`` on these [B, S] / [B, N]
    inputs, the position ``b * S + a + k - 1`` whose final hidden state is its verifier row; R is
    its length. Computed where the inputs live: the trainer computes it on its host copies and
    passes it as ``verifier_positions`` (static padding adds no row: padding blocks have no anchor
    and the padded context is another, unsupervised document)."""
    label_pos, label_valid = label_slots(doc_ids, anchors, block_size)
    B, S = loss_mask.shape
    key = label_pos - 1 + S * torch.arange(B, device=label_pos.device).view(B, 1, 1)
    return key[supervised_slots(label_pos, label_valid, loss_mask)].sort().values


def pad_to_static(aux_hidden, input_ids, loss_mask, position_ids, anchors, s_max: int, n_max: int):
    """Pad [B, S] rows to s_max tokens and [B, N] anchors to n_max (see ``dflash_loss``; no copy of
    what already has its size)."""
    B, S = input_ids.shape
    if S > s_max or anchors.shape[1] > n_max:
        raise ValueError(
            f"batch of {S} tokens / {anchors.shape[1]} blocks exceeds the static shape ({s_max}, {n_max})"
        )
    pad = s_max - S

    def grow(x: torch.Tensor, value: float = 0) -> torch.Tensor:
        if pad == 0:
            return x
        tail = torch.full((B, pad, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
        return torch.cat([x, tail], dim=1)

    extra = torch.arange(pad, device=position_ids.device).expand(B, pad)
    if anchors.shape[1] < n_max:
        anchors = torch.cat([anchors, anchors.new_full((B, n_max - anchors.shape[1]), -1)], dim=1)
    return (
        grow(aux_hidden),
        grow(input_ids),
        grow(loss_mask),
        torch.cat([position_ids, extra], dim=1) if pad else position_ids,
        anchors,
    )


def dflash_loss(
    drafter: DFlashDraftModel,
    aux_hidden: torch.Tensor,
    final_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    loss_cfg: LossConfig,
    position_ids: torch.Tensor | None = None,
    attention: str = "sdpa",
    verifier_metrics: bool = True,
    static_shape: tuple[int, int] | None = None,
    on_phase: Callable[[str], None] | None = None,
    normalizer: float | None = None,
    num_rows: int | None = None,
    selector_scale: float | None = None,
    verifier_positions: torch.Tensor | None = None,
    context_kv: list[ContextKV] | None = None,
) -> ObjectiveOutput:
    """One DFlash training forward: blocks -> drafter -> chunked verifier-logit loss (+ DFlash2's
    selector loss).

    aux_hidden [B, S, n_tap*H] tapped target states; final_hidden [B, S, H] post-norm target state;
    input_ids / loss_mask [B, S]; anchors [B, N] int64 (-1 = no block); embed_weight / lm_head_weight
    [V, H] frozen target tensors; position_ids [B, S] restart at 0 per packed document (default: one
    document per row, positions 0..S-1). Slot k of the block at anchor a predicts input_ids[a+k]
    with weight exp(-(k-1)/gamma) * loss_mask[a+k]; its verifier row is final_hidden[a+k-1].
    ``verifier_metrics`` computes the verifier argmax (accuracy and tau_hat against the target's
    greedy token) even when the loss itself needs no verifier logits. ``static_shape=(S_max, N_max)``
    pads the context to S_max tokens (an extra unsupervised document nobody sees) and the blocks to
    N_max (padding blocks see only themselves): every call then has the same shapes, so a compiled
    flex_attention compiles once. The result does not change. ``on_phase(name)`` is called when the
    drafter forward (``"drafter_forward"``: blocks, mask, layers) and the chunked loss (``"loss"``, its
    gradient included) end, for step timing. ``normalizer``: the loss is ``sum_r w_r l_r /
    normalizer`` (None: this batch's ``sum_r w_r``); the trainer passes 1 and divides the step's
    gradients once by the global weight sum. ``num_rows``: R when the caller knows it
    (``num_supervised`` on its host copies): no host sync in the whole call (the count and the
    labels' range are asserted on the device); None: R is found on the device (host syncs).
    ``selector_scale``: DFlash2's selector loss coefficient at this step (``selector_coefficient``;
    None: ``loss_cfg.selector``). For DFlash2 the tau sums follow its selector chain.
    ``verifier_positions``: ``supervised_positions`` of these inputs on the host (the trainer's host
    copies; asserted on the device). The verifier's logits, softmax and argmax are computed once per
    distinct position the supervised rows read (``verifier_loss(verifier_index=...)``, rows in
    position order), and with it that needs no host sync; None: read back from the device.
    ``context_kv``: the drafter's ``context_states`` of these (padded) context rows, computed once
    for several calls on chunks of the anchors (``dflash.drafter.step``); ``aux_hidden`` is then
    unused.
    """
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
    final_in = final_hidden  # the verifier's rows: padding adds no position a supervised row reads
    if static_shape is not None:
        aux_hidden, input_ids, loss_mask, position_ids, anchors = pad_to_static(
            aux_hidden, input_ids, loss_mask, position_ids, anchors, *static_shape
        )
    doc_ids = doc_ids_from_positions(position_ids)
    arch = drafter.arch
    blocks = make_blocks(input_ids, position_ids, doc_ids, anchors, drafter.block_size, arch.mask_token_id)
    masks = build_masks(
        anchors, doc_ids, drafter.block_size, attention, arch.layer_types, arch.sliding_window
    )
    noise = torch.nn.functional.embedding(blocks.block_ids, embed_weight)
    hidden = drafter(  # [B, Q, H]
        noise, aux_hidden, position_ids, blocks.block_positions, masks, context_kv=context_kv
    )
    if on_phase is not None:
        on_phase("drafter_forward")
    coefs = coefficients(loss_cfg)
    selector = getattr(drafter, "candidate_selector", None)
    wants_verifier = verifier_metrics or (selector is not None and loss_cfg.selector_label == "verifier")
    verifier_hidden = None
    if needs_verifier_logits(coefs, wants_verifier):
        verifier_hidden = final_in.reshape(-1, final_in.shape[-1])
    dpace = loss_cfg.dpace > 0
    sup = _supervised_slots(
        blocks,
        loss_mask,
        input_ids,
        final_in.shape[1] if verifier_hidden is not None else None,
        None if dpace else loss_cfg.gamma,
        hidden,
        num_rows,
    )
    if num_rows is not None:
        _assert_labels_in_vocab(sup.labels, lm_head_weight.shape[0])
    verifier_index = _host_verifier_index(sup, verifier_positions)
    rows_hidden = hidden.reshape(-1, hidden.shape[-1])[sup.rows]
    out = verifier_loss(
        rows_hidden,
        verifier_hidden,
        lm_head_weight,
        sup.labels,
        sup.weights.view(-1)[sup.rows],
        temperature=loss_cfg.temperature,
        chunk_size=loss_cfg.chunk_size,
        mem_budget_gib=loss_cfg.mem_budget_gib,
        compile=loss_cfg.compile,
        normalizer=normalizer,
        checked_rows=num_rows is not None
        and (dpace or _all_weighted(drafter.block_size, loss_cfg.gamma, hidden.dtype)),
        coefs=coefs,
        reweight=_dpace_reweight(sup, loss_cfg.dpace) if dpace else None,
        reweight_normalizer=loss_cfg.dpace_normalizer,
        verifier_index=verifier_index,
    )
    loss, sel = out.loss, None
    if selector is not None:
        sel = _selector_step(selector, rows_hidden, lm_head_weight, input_ids, blocks, sup, out, loss_cfg)
        scale = loss_cfg.selector if selector_scale is None else selector_scale
        divided_by = normalizer if normalizer is not None else out.weight_sum
        if divided_by is None:  # the loss's own normaliser: its weight sum
            divided_by = sup.weights.view(-1)[sup.rows].sum()
        loss = loss + (scale * sel.loss_sum / divided_by).to(loss.dtype)
    if on_phase is not None:
        on_phase("loss")
    return _objective_output(out, loss, sup, anchors, normalizer, sel, str(loss_cfg.selector_label))


def selector_coefficient(loss_cfg: LossConfig, step: int) -> float:
    """DFlash2's selector coefficient at optimizer step ``step`` (0-based): ``loss.selector``,
    reached linearly over ``loss.selector_warmup_steps``."""
    ramp = loss_cfg.selector_warmup_steps
    return loss_cfg.selector * (min(1.0, (step + 1) / ramp) if ramp > 0 else 1.0)


def _selector_step(selector, rows_hidden, head, input_ids, blocks, sup, out, loss_cfg) -> SelectorOutput:
    """DFlash2's selector loss and hits on the supervised rows (:mod:`dflash.loss.selector`)."""
    B, N, bs = blocks.label_pos.shape
    prev_pos = (blocks.label_pos - 1).clamp(min=0).view(B, N * bs)
    prev_slots = input_ids.gather(1, prev_pos).view(B * N, bs)
    va = out.stats.verifier_argmax
    labels = va if loss_cfg.selector_label == "verifier" else sup.labels
    if labels is None:
        raise ValueError("loss.selector_label=verifier needs the verifier's logits")
    prev_verifier = None
    if va is not None:  # the chain after the verifier's tokens: slot k follows slot k-1's argmax
        slots = torch.zeros(B * N * bs, dtype=torch.long, device=va.device)
        slots[sup.rows] = va.clamp(min=0)
        slots = slots.view(B * N, bs)
        prev_v = prev_slots.clone()
        prev_v[:, 2:] = slots[:, 1:-1]
        prev_verifier = prev_v.view(-1)[sup.rows]
    base = sup.weights.view(-1)[sup.rows]
    chunk = loss_cfg.chunk_size or default_chunk_size(
        head.shape[0], loss_cfg.mem_budget_gib, with_verifier=False
    )
    return selector_loss(
        selector,
        rows_hidden,
        head,
        prev_slots.view(-1)[sup.rows],
        labels,
        base if loss_cfg.selector_weighting == "base" else torch.ones_like(base),
        missing=str(loss_cfg.selector_missing),
        chunk=chunk,
        previous_verifier=prev_verifier,
    )


@dataclass
class _Supervised:
    """The supervised slots of a batch: ``supervised`` / ``weights`` [B, N, bs], and per
    supervised row (R of them) its index in [B*N*bs], data label and, when the verifier is
    computed, the position ``b * S + a + k - 1`` of its verifier row (the rows then in the order of
    those positions, else in [B*N*bs] order)."""

    supervised: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    verifier_index: torch.Tensor | None


def _supervised_slots(
    blocks,
    loss_mask: torch.Tensor,
    input_ids: torch.Tensor,
    verifier_len: int | None,
    gamma: float | None,
    hidden: torch.Tensor,
    num_rows: int | None,
) -> _Supervised:
    """The supervised slots, weighted by the decay of ``gamma`` (None: 1 each, D-PACE weighs them
    later); with ``num_rows`` (R known) found without a host sync. ``verifier_len``: the length S of
    the rows of the verifier's positions (None: no verifier)."""
    B, N, bs = blocks.label_pos.shape
    flat_pos = blocks.label_pos.view(B, N * bs)
    supervised = supervised_slots(blocks.label_pos, blocks.label_valid, loss_mask)
    weights = supervised.to(_weight_dtype(hidden.dtype))
    if gamma is not None:
        weights = weights * slot_weights(bs, gamma, hidden.device, _weight_dtype(hidden.dtype))
    if num_rows is None:
        rows = supervised.view(-1).nonzero().squeeze(1)  # indices into [B*N*bs]
    else:
        torch._assert_async(supervised.sum() == num_rows, "num_rows is not the number of supervised slots")
        rows = torch.nonzero_static(supervised.view(-1), size=num_rows).squeeze(1)
    verifier_index = None
    if verifier_len is not None:
        key = rows // (N * bs) * verifier_len + flat_pos.reshape(-1)[rows] - 1
        verifier_index, order = torch.sort(key, stable=True)
        rows = rows[order]
    labels = input_ids.gather(1, flat_pos).reshape(-1)[rows]
    return _Supervised(supervised, weights, rows, labels, verifier_index)


def _host_verifier_index(sup: _Supervised, host: torch.Tensor | None) -> torch.Tensor | None:
    """The rows' verifier positions on the host: the caller's ``verifier_positions`` (asserted equal
    to the device's on the device), else read back (a host sync on an accelerator)."""
    if sup.verifier_index is None:
        return None
    if host is None:
        return sup.verifier_index.cpu()
    if host.shape != sup.verifier_index.shape:
        raise ValueError(
            f"verifier_positions has {host.numel()} rows but the batch supervises {sup.verifier_index.numel()}: "
            "pass supervised_positions of the same inputs"
        )
    device = sup.verifier_index.device
    torch._assert_async(
        (sup.verifier_index == host.to(device, non_blocking=True)).all(),
        "verifier_positions are not the supervised rows' positions (supervised_positions of these inputs)",
    )
    return host


def _dpace_reweight(sup: _Supervised, a: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The D-PACE multipliers of the supervised rows from their losses (:mod:`dflash.loss.dpace`;
    the base weights are 1, so the multipliers are the weights)."""
    B, N, bs = sup.supervised.shape

    def reweight(losses: torch.Tensor) -> torch.Tensor:
        slots = torch.zeros(B * N * bs, dtype=losses.dtype, device=losses.device)
        slots[sup.rows] = losses
        w = dpace_weights(slots.view(B * N, bs), sup.supervised.view(B * N, bs), a)
        return w.view(-1)[sup.rows]

    return reweight


def _assert_labels_in_vocab(labels: torch.Tensor, vocab: int) -> None:
    """Every supervised label is a token id in [0, vocab), asserted on the device (no host sync;
    ``verifier_loss`` checks it on the host when it is not told the rows are checked)."""
    torch._assert_async(
        ((labels >= 0) & (labels < vocab)).all(), f"a supervised token id outside [0, V={vocab})"
    )


def _weight_dtype(hidden_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if hidden_dtype == torch.float64 else torch.float32


def _all_weighted(block_size: int, gamma: float, hidden_dtype: torch.dtype) -> bool:
    """Every supervised slot has a weight > 0 (the decay does not underflow): checked on the host."""
    return bool(
        slot_weights(block_size, gamma, torch.device("cpu"), _weight_dtype(hidden_dtype))[1:].gt(0).all()
    )


@torch.no_grad()
def _objective_output(
    out,
    loss: torch.Tensor,
    sup: _Supervised,
    anchors: torch.Tensor,
    normalizer: float | None,
    sel: SelectorOutput | None,
    selector_label: str,
) -> ObjectiveOutput:
    """The batch's loss and its sums for aggregation (see ``ObjectiveOutput``); with DFlash2's
    selector the tau sums are its chain's."""
    B, N, bs = sup.supervised.shape
    base_sum = sup.weights.view(-1)[sup.rows].double().sum()
    weight_sum = out.weight_sum.double() if out.weight_sum is not None else base_sum
    hit = torch.zeros(B * N * bs, dtype=torch.bool, device=anchors.device)
    hit[sup.rows] = out.stats.data_hit
    hit = hit.view(B, N, bs)
    hit_v = torch.zeros_like(hit)
    if out.stats.verifier_hit is not None:
        hit_v.view(-1)[sup.rows] = out.stats.verifier_hit
    real = anchors >= 0
    slot_hit, slot_hit_v = hit, hit_v  # the unary argmax's, per slot
    selector_sums = torch.zeros(len(SELECTOR_SUMS), dtype=torch.float64, device=anchors.device)
    if sel is not None:
        unary_ver = prefix_accept(hit_v).double()
        labels = out.stats.verifier_argmax if selector_label == "verifier" else sup.labels
        selector_sums = torch.stack(
            [
                torch.tensor(float(sup.rows.numel()), dtype=torch.float64, device=anchors.device),
                sel.recall.double().sum(),
                (sel.pick == labels).double().sum(),
                sel.weight_sum.double(),
                sel.loss_sum.detach().double(),
                torch.where(real, 1.0 / unary_ver, 0.0).sum(),
            ]
        )
        hit = torch.zeros_like(hit)
        hit.view(-1)[sup.rows] = sel.pick == sup.labels
        hit_v = torch.zeros_like(hit)
        if sel.pick_verifier is not None:
            hit_v.view(-1)[sup.rows] = sel.pick_verifier == out.stats.verifier_argmax
    tau_data, tau_ver = prefix_accept(hit).double(), prefix_accept(hit_v).double()
    term_sums = torch.zeros(len(TERMS), dtype=torch.float64, device=anchors.device)
    for i, term in enumerate(TERMS):
        if term.name in out.terms:
            term_sums[i] = out.terms[term.name].double() * base_sum
    divided_by = weight_sum if normalizer is None else float(normalizer)
    return ObjectiveOutput(
        loss=loss,
        weight_sum=weight_sum,
        base_weight_sum=base_sum,
        loss_sum=loss.detach().double() * divided_by,
        slot_count=sup.supervised.sum(dim=(0, 1)).double(),
        slot_hit=slot_hit.sum(dim=(0, 1)).double(),
        slot_hit_verifier=slot_hit_v.sum(dim=(0, 1)).double(),
        tau_sum=torch.where(real, tau_data, 0.0).sum(),
        tau_verifier_sum=torch.where(real, tau_ver, 0.0).sum(),
        inv_tau_sum=torch.where(real, 1.0 / tau_data, 0.0).sum(),
        inv_tau_verifier_sum=torch.where(real, 1.0 / tau_ver, 0.0).sum(),
        num_blocks=real.sum().double(),
        term_sums=term_sums,
        num_rows=int(sup.rows.numel()),
        selector_sums=selector_sums,
    )
