"""Evaluate a DFlash drafter on a prompt set: tau, acceptance histogram, TPOT, speedup, losslessness.

Protocol (z-lab/dflash ``benchmark.py``, transformers backend): greedy decoding, each prompt run
twice, with ``block_size = 1`` (plain autoregressive, the baseline) and with the drafter at block
size B, after one untimed warm-up generation of each kind.

- tau = mean over ALL decode steps of all prompts of ``accepted + 1`` (at most B); per prompt, the
  mean over its own steps;
- histogram of the acceptance lengths tau_step = 1..B (counts, every length present);
- TPOT = decode time / new tokens per prompt (see ``GenerationResult.tpot_s``); the reported TPOT is
  the mean over prompts; speedup = mean TPOT(AR) / mean TPOT(DFlash);
- lossless: the speculative output equals the baseline output for every prompt (mismatches are
  listed: in fp32 they mean a bug; in bf16 a near-tie flipped by the block forward's numerics).

The app (``python -m dflash.eval``) loads everything with :func:`load_for_eval`; its config schema
is :class:`EvalAppConfig` (``conf/eval_app.yaml``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING

from dflash.config import LoggingConfig, PathsConfig, TargetConfig
from dflash.drafter.model import DFlashDraftModel, DrafterArch
from dflash.eval.spec_decode import GenerationResult, speculative_generate

log = logging.getLogger(__name__)

SCHEMA_NAME = "dflash_eval_schema"


# ------------------------------------------------------------------------------------- config


@dataclass
class EvalAppConfig:
    """Schema of ``conf/eval_app.yaml`` (``python -m dflash.eval``)."""

    name: str = "eval"
    target: TargetConfig = field(default_factory=TargetConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    drafter_path: str = MISSING
    """An exported drafter directory (config.json + model.safetensors, see dflash.drafter.export)."""
    prompts: str = MISSING
    """JSONL of {"messages": [...]} (prompt = messages before the last assistant one) or a datasets path."""
    split: str = "train"
    """Split of a datasets path."""
    num_prompts: int | None = None
    """Use only the first N usable prompts (None = all)."""
    max_new_tokens: int = 256
    block_size: int | None = None
    """None = the drafter's block size."""
    baseline: bool = True
    """Also run block size 1: needed for speedup, TPOT(AR) and the lossless check."""
    warmup: bool = True
    """One short untimed generation of each kind before timing."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to apply_chat_template, e.g. {enable_thinking: false} for Qwen3."""
    eos_token_ids: list[int] | None = None
    """None = the tokenizer's eos + the target's generation_config eos."""
    step: int = 0
    """train/step the metrics are logged at (e.g. the training step of the evaluated drafter)."""


def register_eval_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=EvalAppConfig)


def eval_config_problems(cfg: EvalAppConfig) -> list[str]:
    """Problems the eval config alone shows (no file read); empty when valid."""
    p = []
    if cfg.max_new_tokens < 1:
        p.append(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if cfg.block_size is not None and cfg.block_size < 1:
        p.append(f"block_size={cfg.block_size}: must be >= 1 (1 = plain decoding) or null for the drafter's")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        p.append(f"num_prompts={cfg.num_prompts}: must be >= 1 or null (all prompts)")
    if cfg.device not in ("auto", "cpu", "cuda"):
        p.append(f"device={cfg.device!r} is not one of ['auto', 'cpu', 'cuda']")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        p.append("device=cuda but CUDA is not available; set device=cpu (or auto)")
    if cfg.logging.mode not in ("online", "offline", "disabled"):
        p.append(f"logging.mode={cfg.logging.mode!r} is not one of ['online', 'offline', 'disabled']")
    if cfg.target.dtype not in ("auto", "float32", "bfloat16", "float16"):
        p.append(f"target.dtype={cfg.target.dtype!r} is not one of ['auto', 'float32', 'bfloat16', 'float16']")
    return p


def _raise(problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {m}" for m in problems)
        raise ValueError(f"{len(problems)} eval config problem(s):\n{lines}")


# ------------------------------------------------------------------------------------- report


@dataclass
class PromptResult:
    index: int
    prompt_len: int
    output_ids: list[int]
    accept_lengths: list[int]
    tpot_s: float
    num_target_forwards: int
    baseline_ids: list[int] | None = None
    tpot_ar_s: float | None = None

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")

    @property
    def first_mismatch(self) -> int | None:
        """First index where the output differs from the baseline (None when equal or no baseline)."""
        if self.baseline_ids is None or self.output_ids == self.baseline_ids:
            return None
        n = min(len(self.output_ids), len(self.baseline_ids))
        return next((i for i in range(n) if self.output_ids[i] != self.baseline_ids[i]), n)

    @property
    def matches(self) -> bool | None:
        return None if self.baseline_ids is None else self.output_ids == self.baseline_ids


@dataclass
class EvalReport:
    block_size: int
    max_new_tokens: int
    results: list[PromptResult]
    tau: float
    """Mean accepted + 1 over every decode step of every prompt."""
    accept_len_hist: dict[int, int]
    """tau_step (1..block_size) -> number of decode steps."""
    tpot_s: float
    """Mean over prompts of the speculative TPOT."""
    tpot_ar_s: float | None
    """Mean over prompts of the block-size-1 TPOT (None without baseline)."""
    speedup: float | None
    """tpot_ar_s / tpot_s (None without baseline)."""
    lossless: bool | None
    """Every output equals its baseline (None without baseline)."""
    mismatches: list[str]

    @property
    def num_steps(self) -> int:
        return sum(len(r.accept_lengths) for r in self.results)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_steps"], d["num_output_tokens"] = self.num_steps, self.num_output_tokens
        for r, rd in zip(self.results, d["results"], strict=True):
            rd["tau"], rd["matches"], rd["first_mismatch"] = r.tau, r.matches, r.first_mismatch
        return d


def _mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return str(ids)
    try:
        return repr(tokenizer.decode(ids))
    except Exception:  # noqa: BLE001 - a report must not fail on a decode problem
        return str(ids)


def build_report(results: list[PromptResult], block_size: int, max_new_tokens: int, tokenizer: Any = None) -> EvalReport:
    steps = [a for r in results for a in r.accept_lengths]
    hist = dict.fromkeys(range(1, block_size + 1), 0)
    for a in steps:
        if not 1 <= a <= block_size:
            raise ValueError(f"acceptance length {a} outside 1..{block_size}")
        hist[a] += 1
    has_baseline = bool(results) and all(r.baseline_ids is not None for r in results)
    tpot = _mean(r.tpot_s for r in results)
    tpot_ar = _mean(r.tpot_ar_s for r in results) if has_baseline else None
    speedup = tpot_ar / tpot if has_baseline and tpot > 0 else None
    mismatches = []
    for r in results:
        i = r.first_mismatch
        if i is not None:
            mismatches.append(
                f"prompt {r.index}: output differs from the block-size-1 baseline at new token {i} "
                f"(speculative {_decode(tokenizer, r.output_ids[i:i + 8])} vs baseline "
                f"{_decode(tokenizer, (r.baseline_ids or [])[i:i + 8])})"
            )
    return EvalReport(
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        results=results,
        tau=sum(steps) / len(steps) if steps else float("nan"),
        accept_len_hist=hist,
        tpot_s=tpot,
        tpot_ar_s=tpot_ar,
        speedup=speedup,
        lossless=(not mismatches) if has_baseline else None,
        mismatches=mismatches,
    )


def evaluate(
    target: torch.nn.Module,
    drafter: DFlashDraftModel | None,
    embed: torch.Tensor | None,
    head: torch.Tensor | None,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    layer_ids: list[int],
    block_size: int,
    eos_ids: set[int],
    baseline: bool = True,
    warmup: bool = True,
    progress: Callable[[int, PromptResult], None] | None = None,
) -> EvalReport:
    """Speculative (and, with ``baseline``, block-size-1) greedy generation of every prompt.

    prompts: token ids (e.g. from :func:`load_prompts`). tokenizer: only for readable mismatch
    reports (may be None). ``progress(i, result)`` is called after each prompt.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if drafter is None:
        block_size = 1

    def gen(ids: list[int], bs: int, n: int) -> GenerationResult:
        return speculative_generate(
            target, drafter if bs > 1 else None, embed, head, ids, max_new_tokens=n,
            eos_token_ids=eos_ids, layer_ids=layer_ids, block_size=bs,
        )

    if warmup:
        n = min(max_new_tokens, 2 * block_size + 1)
        if baseline:
            gen(prompts[0], 1, n)
        gen(prompts[0], block_size, n)
    results = []
    for i, ids in enumerate(prompts):
        ar = gen(ids, 1, max_new_tokens) if baseline else None
        spec = gen(ids, block_size, max_new_tokens)
        r = PromptResult(
            index=i,
            prompt_len=len(ids),
            output_ids=spec.output_ids,
            accept_lengths=spec.accept_lengths,
            tpot_s=spec.tpot_s,
            num_target_forwards=spec.num_target_forwards,
            baseline_ids=ar.output_ids if ar is not None else None,
            tpot_ar_s=ar.tpot_s if ar is not None else None,
        )
        log.info(
            "prompt %d/%d: %d tokens in, %d out, tau %.2f, tpot %.2f ms%s",
            i + 1, len(prompts), len(ids), len(r.output_ids), r.tau, 1e3 * r.tpot_s,
            "" if ar is None else f", tpot AR {1e3 * ar.tpot_s:.2f} ms, {'lossless' if r.matches else 'MISMATCH'}",
        )
        results.append(r)
        if progress is not None:
            progress(i, r)
    return build_report(results, block_size, max_new_tokens, tokenizer)


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_table(report: EvalReport) -> str:
    """A printable per-prompt table, the totals, the acceptance histogram and the lossless verdict."""
    has_ar = report.tpot_ar_s is not None
    head = f"{'prompt':>6} {'in':>6} {'out':>6} {'steps':>6} {'tau':>6} {'tpot_ms':>9}"
    if has_ar:
        head += f" {'tpot_ar_ms':>10} {'speedup':>8} {'lossless':>8}"
    lines = [
        f"DFlash eval: {len(report.results)} prompts, block size {report.block_size}, "
        f"max_new_tokens {report.max_new_tokens}",
        head,
        "-" * len(head),
    ]

    def row(label: str, n_in: str, n_out: int, steps: int, tau: float, tpot: float, tpot_ar, match) -> str:
        s = f"{label:>6} {n_in:>6} {n_out:>6} {steps:>6} {_fmt(tau, '.2f'):>6} {_fmt(tpot * 1e3, '.3f'):>9}"
        if has_ar:
            sp = tpot_ar / tpot if tpot_ar is not None and tpot and not math.isnan(tpot) else None
            s += f" {_fmt(None if tpot_ar is None else tpot_ar * 1e3, '.3f'):>10} {_fmt(sp, '.2f'):>7}x"
            s += f" {'yes' if match else 'NO':>8}"
        return s

    for r in report.results:
        lines.append(row(str(r.index), str(r.prompt_len), len(r.output_ids), len(r.accept_lengths), r.tau,
                         r.tpot_s, r.tpot_ar_s, r.matches))
    lines.append("-" * len(head))
    lines.append(row("all", "", report.num_output_tokens, report.num_steps, report.tau, report.tpot_s,
                     report.tpot_ar_s, report.lossless))
    lines.append("")
    lines.append(f"tau = {_fmt(report.tau, '.3f')} (mean accepted+1 over {report.num_steps} decode steps)")
    if has_ar:
        lines.append(
            f"speedup = TPOT(AR) {_fmt(report.tpot_ar_s * 1e3, '.3f')} ms / TPOT(DFlash) "
            f"{_fmt(report.tpot_s * 1e3, '.3f')} ms = {_fmt(report.speedup, '.2f')}x"
        )
    lines.append("acceptance length histogram (tau_step = accepted + 1):")
    total = max(report.num_steps, 1)
    peak = max(report.accept_len_hist.values(), default=0) or 1
    for k, c in report.accept_len_hist.items():
        lines.append(f"  {k:>3} {c:>7} {100.0 * c / total:5.1f}% {'#' * round(40 * c / peak)}")
    if report.lossless is None:
        lines.append("lossless: not checked (baseline=false)")
    elif report.lossless:
        lines.append(f"lossless: yes (all {len(report.results)} outputs equal the block-size-1 baseline)")
    else:
        lines.append(f"lossless: NO ({len(report.mismatches)} of {len(report.results)} prompts differ)")
        lines += [f"  {m}" for m in report.mismatches]
    return "\n".join(lines)


def report_metrics(report: EvalReport) -> dict[str, float]:
    """W&B metrics: eval/tau, eval/tpot_ms, eval/accept_len_hist/{k}, eval/num_steps,
    eval/num_output_tokens and, with a baseline, eval/speedup, eval/tpot_ar_ms, eval/lossless (1/0)."""
    m: dict[str, float] = {
        "eval/tau": float(report.tau),
        "eval/tpot_ms": float(report.tpot_s * 1e3),
        "eval/block_size": float(report.block_size),
        "eval/num_prompts": float(len(report.results)),
        "eval/num_steps": float(report.num_steps),
        "eval/num_output_tokens": float(report.num_output_tokens),
    }
    if report.tpot_ar_s is not None:
        m["eval/tpot_ar_ms"] = float(report.tpot_ar_s * 1e3)
        m["eval/speedup"] = float(report.speedup) if report.speedup is not None else float("nan")
        m["eval/lossless"] = float(bool(report.lossless))
    for k, c in report.accept_len_hist.items():
        m[f"eval/accept_len_hist/{k}"] = float(c)
    return m


# ------------------------------------------------------------------------------------- loading


@dataclass
class EvalSetup:
    target: torch.nn.Module
    drafter: DFlashDraftModel
    embed: torch.Tensor
    head: torch.Tensor
    tokenizer: Any
    prompts: list[list[int]]
    layer_ids: list[int]
    block_size: int
    eos_ids: set[int]
    device: torch.device
    target_path: str
    drafter_path: str


def _abs_path(path: str) -> str:
    """A local path made absolute against the launch directory (Hydra does not chdir); a hub id as is."""
    from hydra.utils import to_absolute_path

    p = Path(path).expanduser()
    local = p if p.is_absolute() else Path(to_absolute_path(str(p)))
    return str(local) if local.exists() or path.startswith((".", "/", "~")) else path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on GPU, float32 on CPU (as training)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def drafter_problems(arch: DrafterArch, exported_cfg: dict, meta: Any, cfg: EvalAppConfig) -> list[str]:
    """Why an exported drafter cannot run against this target (empty when it can)."""
    p = []
    where = f"drafter_path={cfg.drafter_path}"
    tgt = f"target {cfg.target.name} ({cfg.target.path})"
    fix = "evaluate the drafter against the target it was trained for (target=... / target.path=...)"
    if arch.hidden_size != meta.hidden_size:
        p.append(f"{where}: the drafter's hidden_size={arch.hidden_size} differs from {tgt} hidden_size="
                 f"{meta.hidden_size} (it reuses the target's embedding and lm_head); {fix}")
    if arch.vocab_size != meta.vocab_size:
        p.append(f"{where}: the drafter's vocab_size={arch.vocab_size} differs from {tgt} vocab_size="
                 f"{meta.vocab_size}; {fix}")
    n_layers = exported_cfg.get("num_target_layers")
    if n_layers is not None and int(n_layers) != meta.num_layers:
        p.append(f"{where}: the drafter was exported for a {n_layers}-layer target, {tgt} has "
                 f"{meta.num_layers} layers; {fix}")
    bad = [i for i in arch.target_layer_ids if not 0 <= i < meta.num_layers]
    if bad:
        p.append(f"{where}: the drafter's tap ids (dflash_config.target_layer_ids={arch.target_layer_ids}) "
                 f"include {bad}, outside the {meta.num_layers} decoder layers of {tgt}; {fix}")
    if cfg.target.layer_ids is not None and [int(i) for i in cfg.target.layer_ids] != list(arch.target_layer_ids):
        p.append(f"target.layer_ids={list(cfg.target.layer_ids)} but the drafter was trained on taps "
                 f"{arch.target_layer_ids}; set target.layer_ids={list(arch.target_layer_ids)} "
                 f"(or target.layer_ids=null to use the drafter's)")
    if not 0 <= arch.mask_token_id < meta.vocab_size:
        p.append(f"{where}: the drafter's mask_token_id={arch.mask_token_id} is outside the target vocabulary "
                 f"[0, {meta.vocab_size}); {fix}")
    return p


def prompt_from_record(record: Any, tokenizer: Any, template_kwargs: dict[str, Any]) -> list[int]:
    """Prompt ids of one record: the chat-template prompt of its messages (up to the last assistant
    message), or for a pretokenized record (input_ids + loss_mask, no messages) the ids before the
    first supervised token. Raises ValueError (MalformedConversation) on unusable records."""
    from dflash.data.chat import prompt_ids
    from dflash.data.sources import parse_messages
    from dflash.data.tokenize import pretokenized

    if isinstance(record, dict) and "input_ids" in record and "messages" not in record:
        ids, mask = pretokenized(record)
        first = int(mask.argmax()) if mask.any() else len(ids)
        if first == 0:
            raise ValueError("pretokenized record supervises its first token: no prompt")
        return [int(i) for i in ids[:first]]
    ids = prompt_ids(tokenizer, parse_messages(record), **template_kwargs)
    if not ids:
        raise ValueError("empty prompt")
    return ids


def load_prompts(
    path: str,
    tokenizer: Any,
    *,
    split: str = "train",
    num_prompts: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    field_name: str = "prompts",
) -> list[list[int]]:
    """Prompt ids from a JSONL of {"messages": [...]} or a ``datasets`` path (first ``num_prompts``
    usable records; unusable ones are skipped with a warning)."""
    import jinja2

    from dflash.data.sources import load_conversations

    p = Path(path)
    if p.suffix in (".jsonl", ".json") and not p.exists():
        raise ValueError(f"{field_name}={path!r} does not exist; set {field_name}=<a JSONL of "
                         '{"messages": [...]} or a datasets path>')
    out: list[list[int]] = []
    skipped = 0
    for idx, rec in enumerate(load_conversations(str(path), split)):
        try:
            out.append(prompt_from_record(rec, tokenizer, template_kwargs or {}))
        except (ValueError, jinja2.TemplateError) as exc:
            skipped += 1
            log.warning("%s record %d skipped: %s", field_name, idx, exc)
            continue
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"{field_name}={path!r}: no usable prompt ({skipped} records skipped); each record "
                         'needs {"messages": [{"role": ..., "content": ...}, ...]}')
    if skipped:
        log.warning("%s: %d records skipped, %d prompts used", field_name, skipped, len(out))
    return out


def eos_ids_of(tokenizer: Any, target: torch.nn.Module | None) -> set[int]:
    """The tokenizer's eos plus the target's generation_config eos (an int or a list)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return ids


def target_embed_and_head(target: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The loaded target's own embedding and lm_head weights [V, H] (shared, no copy): the same
    tensors ``load_embed_and_head`` reads from the checkpoint, without a second copy on the device."""
    try:
        emb, out = target.get_input_embeddings(), target.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    w_e, w_h = getattr(emb, "weight", None), getattr(out, "weight", None)
    if not isinstance(w_e, torch.Tensor) or not isinstance(w_h, torch.Tensor) or w_e.shape != w_h.shape:
        return None, None
    return w_e.detach(), w_h.detach()


def load_for_eval(cfg: EvalAppConfig) -> EvalSetup:
    """Target (full ``*ForCausalLM``, it verifies), exported drafter, embed/head (the target's own
    weights; ``load_embed_and_head`` when the model does not expose them), tokenizer, prompts.

    Every mismatch between the drafter and the target is reported at once, before the target's
    weights load, each naming the field and the fix.
    """
    from transformers import AutoTokenizer

    from dflash.drafter.export import load_exported, load_into
    from dflash.targets.loader import load_embed_and_head, load_target, read_target_meta

    _raise(eval_config_problems(cfg))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.target.dtype, device)
    target_path = _abs_path(cfg.target.path)
    if cfg.target.tiny is not None:
        from dflash.targets.tiny import ensure_tiny_target

        target_path = str(ensure_tiny_target(target_path, cfg.target.tiny))
    drafter_dir = Path(_abs_path(cfg.drafter_path))
    if not drafter_dir.is_dir():
        raise ValueError(f"drafter_path={cfg.drafter_path!r} is not a directory ({drafter_dir}); set "
                         "drafter_path=<a drafter exported with dflash.drafter.export (config.json + model.safetensors)>")
    missing = [f for f in ("config.json", "model.safetensors") if not (drafter_dir / f).is_file()]
    if missing:
        raise ValueError(f"drafter_path={cfg.drafter_path!r} lacks {missing}: not an exported drafter; set "
                         "drafter_path=<a drafter exported with dflash.drafter.export (config.json + model.safetensors)>")
    try:
        arch, state = load_exported(drafter_dir)
    except ValueError as exc:
        raise ValueError(f"drafter_path={cfg.drafter_path!r}: {exc}") from None
    exported_cfg = json.loads((drafter_dir / "config.json").read_text())
    meta = read_target_meta(target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code)
    _raise(drafter_problems(arch, exported_cfg, meta, cfg))
    block_size = cfg.block_size or arch.block_size

    tok_path = _abs_path(cfg.target.tokenizer) if cfg.target.tokenizer else target_path
    tokenizer = AutoTokenizer.from_pretrained(
        tok_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    prompts_path = _abs_path(cfg.prompts)
    prompts = load_prompts(prompts_path, tokenizer, split=cfg.split, num_prompts=cfg.num_prompts,
                           template_kwargs=dict(cfg.chat_template_kwargs))
    too_long = [i for i, ids in enumerate(prompts)
                if meta.max_position_embeddings and len(ids) + cfg.max_new_tokens + block_size > meta.max_position_embeddings]
    if too_long:
        raise ValueError(f"prompts {too_long[:5]}: prompt + max_new_tokens={cfg.max_new_tokens} + block size exceeds the "
                         f"target's max_position_embeddings={meta.max_position_embeddings}; lower max_new_tokens")

    tcfg = type(cfg.target)(**{**asdict(cfg.target), "path": target_path})
    target = load_target(tcfg, device, dtype)
    drafter = DFlashDraftModel(arch)
    load_into(drafter, state)
    drafter.to(device).eval().requires_grad_(False)
    with torch.no_grad():  # parameters only: the RoPE inv_freq buffer stays fp32, as in the target
        for param in drafter.parameters():
            param.data = param.data.to(dtype)
    embed, head = target_embed_and_head(target)
    if embed is None or head is None:
        embed, head = load_embed_and_head(target_path, revision=cfg.target.revision,
                                          trust_remote_code=cfg.target.trust_remote_code)
    eos = set(cfg.eos_token_ids) if cfg.eos_token_ids is not None else eos_ids_of(tokenizer, target)
    return EvalSetup(
        target=target,
        drafter=drafter,
        embed=embed.to(device, dtype),
        head=head.to(device, dtype),
        tokenizer=tokenizer,
        prompts=prompts,
        layer_ids=list(arch.target_layer_ids),
        block_size=block_size,
        eos_ids=eos,
        device=device,
        target_path=target_path,
        drafter_path=str(drafter_dir),
    )


# ------------------------------------------------------------------------------------- app


def _histogram_object(report: EvalReport):
    """A wandb.Histogram of the acceptance lengths (bins centred on 1..B)."""
    import numpy as np
    import wandb

    counts = np.array([report.accept_len_hist[k] for k in sorted(report.accept_len_hist)], dtype=np.float64)
    edges = np.arange(0.5, report.block_size + 1.0, 1.0)
    return wandb.Histogram(np_histogram=(counts, edges))


def run_app(dcfg: Any, run_dir: Path) -> EvalReport:
    """What ``python -m dflash.eval`` does: load, evaluate, print the table, write report.json, log W&B."""
    from omegaconf import OmegaConf

    from dflash.metrics import WandbLogger, build_logger

    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, EvalAppConfig), type(obj)
    cfg: EvalAppConfig = obj
    setup = load_for_eval(cfg)
    log.info("eval: target %s, drafter %s, %d prompts, block size %d, taps %s, device %s",
             setup.target_path, setup.drafter_path, len(setup.prompts), setup.block_size, setup.layer_ids, setup.device)
    report = evaluate(
        setup.target, setup.drafter, setup.embed, setup.head, setup.tokenizer, setup.prompts,
        max_new_tokens=cfg.max_new_tokens, layer_ids=setup.layer_ids, block_size=setup.block_size,
        eos_ids=setup.eos_ids, baseline=cfg.baseline, warmup=cfg.warmup,
    )
    print(report_table(report), flush=True)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(dcfg, resolve=True))
    (run_dir / "report.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    metrics = report_metrics(report)
    config = OmegaConf.to_container(dcfg, resolve=True)
    logger = build_logger(cfg.logging, True, run_dir, config, run_name=cfg.name)
    try:
        row: dict[str, Any] = dict(metrics)
        if isinstance(logger, WandbLogger):
            row["eval/accept_len_histogram"] = _histogram_object(report)
        logger.log(row, step=cfg.step)
        logger.summary(metrics)
    except BaseException:
        logger.close(exit_code=1)
        raise
    logger.close()
    return report
