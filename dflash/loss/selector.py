"""DFlash2's selector loss: a k-way cross-entropy over each supervised slot's top-k candidates.

Shape legend: R supervised rows (slots), H hidden, V vocabulary, k candidates (``selector_top_k``).

Per row r: the candidates are the top-k of the drafter's logits ``z = h_r W^T`` (their values, the
unary scores, enter detached: the base loss trains the logits, this loss the selector and, through
its hidden projection, the drafter's hidden state), the predecessor is the true previous token
(the data token before the slot: the anchor for slot 1), and the scores are
``unary + edges(h_r, predecessor, candidates)`` (:class:`dflash.drafter.dflash2.CandidateSelector`).
The loss of the row is ``logsumexp(scores) - scores[label]``; a label that is not among the k
candidates is left out (``exclude``) or takes the place of the k-th candidate with its own logit
(``inject``). Rows are weighted by ``weights`` (the base loss's, or 1).

The top-k needs the drafter's logits once more: a no-grad pass over the vocabulary in chunks of
``chunk`` rows (``[chunk, V]`` fp32 at a time), which the planner counts (``candidate_logits``).

Teacher-forced hits (the pick among the candidates after the true predecessor is the label) chain
into the selector's acceptance: while every earlier slot of a block was hit, the chain's own picks were the
true tokens, so the block's chain acceptance is ``1 +`` the leading run of hits: no walk is needed.
Against the verifier the predecessors are the verifier's argmaxes of the previous slots instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class CandidateSelector(Protocol):
    """What the loss reads of a selector (:class:`dflash.drafter.dflash2.CandidateSelector`, which
    the drafter layer above this one defines)."""

    top_k: int

    def edges(self, hidden: Tensor, previous: Tensor, candidates: Tensor) -> Tensor:
        """hidden [..., H], previous [...] token ids, candidates [..., k] ids -> scores [..., k]."""
        ...


@dataclass
class SelectorOutput:
    """loss_sum: ``sum_r v_r CE_r`` over the rows the loss uses (differentiable); weight_sum: their
    ``sum_r v_r``; per row [R]: ``recall`` (bool: the label is among the k candidates), ``pick``
    (the teacher-forced choice among the k candidates, after the true previous token),
    ``pick_verifier`` (the choice after the verifier's previous token; None without verifier
    argmaxes)."""

    loss_sum: Tensor
    weight_sum: Tensor
    recall: Tensor
    pick: Tensor
    pick_verifier: Tensor | None


@torch.no_grad()
def top_candidates(hidden: Tensor, head: Tensor, k: int, chunk: int) -> tuple[Tensor, Tensor]:
    """The top-k of ``hidden @ head.T`` per row, ``chunk`` rows at a time: (values [R, k] fp32 or
    fp64, ids [R, k]), values in descending order."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    values = torch.empty(hidden.shape[0], k, dtype=dt, device=hidden.device)
    ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    w = head.to(dt)
    for c0 in range(0, hidden.shape[0], chunk):
        v, i = (hidden[c0 : c0 + chunk].to(dt) @ w.T).topk(k, dim=-1)
        values[c0 : c0 + chunk], ids[c0 : c0 + chunk] = v, i
    return values, ids


def selector_loss(
    selector: CandidateSelector,
    hidden: Tensor,
    head: Tensor,
    previous: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    missing: str,
    chunk: int,
    previous_verifier: Tensor | None = None,
) -> SelectorOutput:
    """The selector loss and picks of R rows (module docstring): hidden [R, H] (with grad), head
    [V, H] frozen, previous / labels [R] token ids, weights [R]; ``missing``: ``exclude`` or
    ``inject``; ``previous_verifier`` [R]: the verifier's previous tokens (for ``pick_verifier``)."""
    real_unary, real_cands = unary, cands = top_candidates(hidden.detach(), head, selector.top_k, chunk)
    is_label = cands == labels[:, None]
    recall = is_label.any(-1)
    if missing == "inject":
        gold = (hidden.detach().to(unary.dtype) * head[labels].to(unary.dtype)).sum(-1)
        last = ~recall
        cands = cands.clone()
        cands[:, -1] = torch.where(last, labels, cands[:, -1])
        unary = unary.clone()
        unary[:, -1] = torch.where(last, gold, unary[:, -1])
        is_label = cands == labels[:, None]
        used = torch.ones_like(recall)
    elif missing == "exclude":
        used = recall
    else:
        raise ValueError(f"missing={missing!r}: must be exclude or inject")
    scores = unary + selector.edges(hidden, previous, cands)
    target = is_label.to(torch.long).argmax(-1)
    ce = torch.logsumexp(scores, -1) - scores.gather(-1, target[:, None]).squeeze(-1)
    v = torch.where(used, weights.to(ce.dtype), 0.0)
    loss_sum = (v * ce.masked_fill(~used, 0.0)).sum()
    with torch.no_grad():
        pick = _choose(selector, hidden, previous, real_unary, real_cands)
        pick_verifier = None
        if previous_verifier is not None:
            pick_verifier = _choose(selector, hidden, previous_verifier, real_unary, real_cands)
    return SelectorOutput(loss_sum, v.detach().sum(), recall, pick, pick_verifier)


def _choose(
    selector: CandidateSelector, hidden: Tensor, previous: Tensor, unary: Tensor, cands: Tensor
) -> Tensor:
    """[R] the best of the k candidates after ``previous`` (one step of the chain)."""
    scores = unary + selector.edges(hidden.detach(), previous, cands)
    return cands.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
