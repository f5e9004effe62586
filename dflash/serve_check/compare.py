"""Comparing vLLM's decode of an export with dflash's own: outputs, tau and per-position acceptance.

Both sides count the same thing. A decode step verifies one draft of ``n = block_size - 1`` tokens and
accepts its longest correct prefix, k tokens (``tau_step = k + 1``). Over all steps of all prompts:
``drafts`` = the number of steps, ``accepted`` = the sum of k, ``accepted_per_pos[i]`` = the steps with
k > i (draft position i, 0-based, was accepted), and ``tau = 1 + accepted / drafts``. dflash's
``speculative_generate`` records k + 1 per step; vLLM counts the same per draft
(``vllm:spec_decode_num_drafts``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Acceptance:
    drafts: int
    accepted: int
    accepted_per_pos: list[int]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def rates(self) -> list[float]:
        """Per draft position, the fraction of drafts that accepted it (vLLM's per-position rate)."""
        return [a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_pos]

    @classmethod
    def of_lengths(cls, accept_lengths: list[list[int]], num_spec: int) -> Acceptance:
        """From dflash's acceptance lengths (``tau_step = k + 1``, per prompt, per step)."""
        ks = [a - 1 for steps in accept_lengths for a in steps]
        return cls(len(ks), sum(ks), [sum(k > i for k in ks) for i in range(num_spec)])

    @classmethod
    def of_vllm(cls, case: dict[str, Any]) -> Acceptance:
        """From one case of ``scripts/serve_check_vllm.py``'s result."""
        return cls(int(case["drafts"]), int(case["accepted"]), [int(a) for a in case["accepted_per_pos"]])


@dataclass
class CaseResult:
    """One export served by vLLM, judged against dflash's decode of the drafter as trained."""

    name: str
    kind: str
    """``check`` (must agree), ``corrupt`` (must disagree: the check has to catch it) or ``mixed``
    (mixed sliding/full layers: vLLM's CPU runner refuses it; not checkable on CPU)."""
    description: str
    vllm_error: str | None = None
    num_prompts: int = 0
    num_equal: int = 0
    mismatches: list[str] = field(default_factory=list)
    dflash: Acceptance | None = None
    vllm: Acceptance | None = None
    tau_rel_diff: float | None = None
    agrees: bool = False
    """Every output identical and tau within the tolerance."""
    passed: bool = False
    verdict: str = ""


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (the shorter length when one is a prefix), or None."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def judge(
    name: str,
    kind: str,
    description: str,
    vllm_case: dict[str, Any],
    reference_outputs: list[list[int]] | None,
    reference: Acceptance | None,
    tau_rel_tol: float,
    *,
    differs_from_trained: str | None = None,
) -> CaseResult:
    """The verdict on one case. ``reference_outputs`` / ``reference``: dflash's outputs and acceptance
    on the same prompt ids and block size (None when there is none, e.g. for a refused mixed export).
    ``differs_from_trained``: how the export differs from the drafter as trained (``trained_difference``);
    such an export fails a ``check`` case and is caught as a ``corrupt`` one whatever vLLM decodes: a
    drafter whose acceptance barely depends on what changed (a permuted tap order, on the tiny demo)
    would pass the comparison of tau."""
    r = _judge_served(name, kind, description, vllm_case, reference_outputs, reference, tau_rel_tol)
    if differs_from_trained is None or kind == "mixed":
        return r
    r.passed = kind == "corrupt"
    served = ""
    if r.vllm_error:
        served = f"; vLLM refused it ({r.vllm_error})"
    elif r.vllm is not None and r.dflash is not None:
        served = (
            f"; served by vLLM: {r.num_equal}/{r.num_prompts} outputs identical, tau {r.vllm.tau:.3f} vs "
            f"{r.dflash.tau:.3f} as trained"
        )
    r.verdict = (
        f"caught before serving: {differs_from_trained}{served}"
        if r.passed
        else f"FAILED: the export is not the drafter as trained: {differs_from_trained}{served}"
    )
    return r


def _judge_served(
    name: str,
    kind: str,
    description: str,
    vllm_case: dict[str, Any],
    reference_outputs: list[list[int]] | None,
    reference: Acceptance | None,
    tau_rel_tol: float,
) -> CaseResult:
    """The verdict of vLLM's decode against dflash's (see ``judge``)."""
    r = CaseResult(name, kind, description, vllm_error=vllm_case.get("error"))
    if not vllm_case.get("ok"):
        if kind == "mixed":
            r.passed, r.verdict = True, f"not checkable on CPU: vLLM refused it ({r.vllm_error})"
        elif kind == "corrupt":
            r.passed, r.verdict = True, f"caught: vLLM refused it ({r.vllm_error})"
        else:
            r.verdict = f"FAILED: vLLM could not serve it ({r.vllm_error})"
        return r
    if reference_outputs is None or reference is None:
        r.verdict = "FAILED: vLLM served it but there is no dflash reference to compare with"
        return r
    outputs = vllm_case["outputs"]
    r.num_prompts = len(reference_outputs)
    for i, (ref, got) in enumerate(zip(reference_outputs, outputs, strict=True)):
        j = first_difference(ref, got)
        if j is None:
            r.num_equal += 1
        else:
            r.mismatches.append(f"prompt {i}: new token {j}: dflash {ref[j : j + 4]}, vLLM {got[j : j + 4]}")
    r.dflash, r.vllm = reference, Acceptance.of_vllm(vllm_case)
    r.tau_rel_diff = (r.vllm.tau - r.dflash.tau) / r.dflash.tau
    r.agrees = r.num_equal == r.num_prompts and abs(r.tau_rel_diff) <= tau_rel_tol
    what = (
        f"{r.num_equal}/{r.num_prompts} outputs identical, tau {r.vllm.tau:.3f} vs {r.dflash.tau:.3f} "
        f"({100 * r.tau_rel_diff:+.1f}%, tolerance {100 * tau_rel_tol:.0f}%)"
    )
    if kind == "corrupt":
        r.passed = not r.agrees
        r.verdict = f"caught: {what}" if r.passed else f"FAILED: not caught, vLLM agrees with dflash: {what}"
    else:
        r.passed = r.agrees
        r.verdict = f"agree: {what}" if r.passed else f"FAILED: {what}"
    return r
