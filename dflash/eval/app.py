"""``python -m dflash.eval``: the app (its schema is :class:`~dflash.eval.config.EvalAppConfig`).

:func:`eval_task` checks the config, reads the benchmarks of ``suite`` (before any model loads: a
missing dataset is one error naming it), loads everything with
:func:`~dflash.eval.loading.load_for_eval`, decodes, prints the table, writes ``report.json`` and
``config.yaml`` to the run dir and logs ``eval/*`` to W&B. Two modes:

- ``prompts=<file>``: :func:`~dflash.eval.results.evaluate` over the prompts (one report);
- ``suite=...``: every benchmark's conversations turn by turn (:mod:`dflash.eval.suite_run`), one
  row, histogram and ``report.json`` entry per benchmark, ``eval/<benchmark>/*`` in W&B.

Launched with torchrun, rank r decodes prompts (or conversations) r, r + W, ... on its own device
(``cuda:LOCAL_RANK``; gloo on CPU), the results are gathered on rank 0, and rank 0 alone reports.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from dflash.config import plain_dict
from dflash.eval.config import EvalAppConfig
from dflash.eval.loading import EvalSetup, eval_config_problems, load_for_eval, raise_problems
from dflash.eval.results import EvalReport, build_report, evaluate, report_metrics, report_table
from dflash.eval.suite_run import (
    BenchmarkReport,
    Decoder,
    TurnResult,
    benchmark_report,
    decode_conversations,
    gather_to_rank0,
    suite_metrics,
    suite_table,
)
from dflash.eval.suites import (
    Conversation,
    load_suite,
    render_turn,
    suite_template_kwargs,
)
from dflash.files import atomic_write

log = logging.getLogger(__name__)

Suite = dict[str, tuple[list[Conversation], str]]
"""Benchmark name -> (its sampled conversations, where its data came from)."""


def _histogram_object(report: EvalReport):
    """A wandb.Histogram of the acceptance lengths (bins centred on 1..B)."""
    import numpy as np
    import wandb

    counts = np.array([report.accept_len_hist[k] for k in sorted(report.accept_len_hist)], dtype=np.float64)
    edges = np.arange(0.5, report.block_size + 1.0, 1.0)
    return wandb.Histogram(np_histogram=(counts, edges))


def _load_suite(cfg: EvalAppConfig) -> Suite | None:
    """The conversations of every benchmark of ``suite`` (None without a suite)."""
    suite = load_suite(cfg.suite, cfg.data_dir, cfg.max_samples, cfg.seed)
    return suite or None


def _process_group(cfg: EvalAppConfig) -> tuple[int, int]:
    """(rank, world size): a process group on a torchrun launch of several processes (NCCL on
    CUDA, gloo on CPU), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    from dflash.config.resolve import resolve_device

    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")), field="device")
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.gather_timeout_s), **kwargs
    )
    return dist.get_rank(), world


def _decoder(cfg: EvalAppConfig, setup: EvalSetup, template_kwargs: dict[str, Any]) -> Decoder:
    return Decoder(
        target=setup.target,
        drafter=setup.drafter,
        embed=setup.embed,
        head=setup.head,
        tokenizer=setup.tokenizer,
        layer_ids=setup.layer_ids,
        block_size=setup.block_size,
        eos_ids=setup.eos_ids,
        max_new_tokens=cfg.max_new_tokens,
        baseline=cfg.baseline,
        template_kwargs=template_kwargs,
        max_positions=setup.max_positions,
    )


def _run_suite(
    cfg: EvalAppConfig, setup: EvalSetup, suite: Suite, rank: int, world: int
) -> list[BenchmarkReport]:
    """This rank's share of every benchmark, gathered; the reports on rank 0 ([] elsewhere)."""
    from dflash.cli import value_errors_are_user_errors
    from dflash.metrics import progress_bar

    dec = _decoder(cfg, setup, suite_template_kwargs(dict(cfg.data.chat_template_kwargs)))
    shares = {n: convs[rank::world] for n, (convs, _) in suite.items()}
    first = next((c for share in shares.values() for c in share), None)
    if cfg.warmup and first is not None:  # one short untimed generation of each kind
        ids = render_turn(setup.tokenizer, [{"role": "user", "content": first.turns[0]}], dec.template_kwargs)
        dec.decode(ids, max_new_tokens=min(cfg.max_new_tokens, 2 * setup.block_size + 1))
    turns: list[TurnResult] = []
    total = sum(len(c.turns) for share in shares.values() for c in share)
    with progress_bar(total, 0, rank == 0, desc="eval") as bar, value_errors_are_user_errors():
        for name, share in shares.items():
            turns += decode_conversations(
                dec, name, share, progress=lambda _t: bar.update(1) if bar is not None else None
            )
    everything = gather_to_rank0(turns)
    if everything is None:
        return []
    return [
        benchmark_report(
            n,
            source,
            [t for t in everything if t.benchmark == n],
            setup.block_size,
            cfg.max_new_tokens,
            setup.tokenizer,
        )
        for n, (_, source) in suite.items()
    ]


def _run_prompts(cfg: EvalAppConfig, setup: EvalSetup, rank: int, world: int) -> EvalReport | None:
    """This rank's prompts (rank, rank + world, ...), gathered; the report on rank 0 (None elsewhere)."""
    from dflash.metrics import progress_bar

    share = setup.prompts[rank::world]
    results = []
    if share:
        with progress_bar(len(share), 0, rank == 0, desc="eval") as bar:
            report = evaluate(
                setup.target,
                setup.drafter,
                setup.embed,
                setup.head,
                setup.tokenizer,
                share,
                max_new_tokens=cfg.max_new_tokens,
                layer_ids=setup.layer_ids,
                block_size=setup.block_size,
                eos_ids=setup.eos_ids,
                baseline=cfg.baseline,
                warmup=cfg.warmup,
                progress=lambda i, r: bar.update(1) if bar is not None else None,
                verbose=False,
            )
        results = [replace(r, index=rank + r.index * world) for r in report.results]
    everything = gather_to_rank0(results)
    if everything is None:
        return None
    ordered = sorted(everything, key=lambda r: r.index)
    return build_report(ordered, setup.block_size, cfg.max_new_tokens, setup.tokenizer)


def _suite_json(cfg: EvalAppConfig, setup: EvalSetup, reports: list[BenchmarkReport], world: int) -> dict:
    return {
        "suite": [b.name for b in reports],
        "target": setup.target_path,
        "drafter": setup.drafter_path,
        "block_size": setup.block_size,
        "max_new_tokens": cfg.max_new_tokens,
        "max_samples": cfg.max_samples,
        "seed": cfg.seed,
        "template_kwargs": suite_template_kwargs(dict(cfg.data.chat_template_kwargs)),
        "num_ranks": world,
        "benchmarks": {b.name: b.to_dict() for b in reports},
    }


def _write_and_log(
    cfg: EvalAppConfig,
    dcfg: Any,
    run_dir: Path,
    table: str,
    report: dict,
    metrics: dict[str, float],
    histograms: dict[str, EvalReport],
) -> None:
    """Print the table, write report.json and config.yaml, log the metrics and, to W&B, each report
    of ``histograms`` as a histogram under its key."""
    from omegaconf import OmegaConf

    from dflash.metrics import WandbLogger, build_logger

    print(table, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(dcfg, resolve=True))
    atomic_write(run_dir / "report.json", json.dumps(report, indent=1, default=str))
    logger = build_logger(cfg.logging, True, run_dir, plain_dict(dcfg), run_name=cfg.name)
    try:
        row: dict[str, Any] = dict(metrics)
        if isinstance(logger, WandbLogger):
            row.update({key: _histogram_object(rep) for key, rep in histograms.items()})
        logger.log(row, step=cfg.step)
        logger.summary(metrics)
    except BaseException:
        logger.close(exit_code=1)
        raise
    logger.close()
    print(f"report: {run_dir / 'report.json'}  config: {run_dir / 'config.yaml'}", flush=True)


def eval_task(dcfg: Any, run_dir: Path) -> int:
    """What ``python -m dflash.eval`` does: load, decode, print the table, write report.json, log W&B."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from dflash.cli import value_errors_are_user_errors

    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, EvalAppConfig), type(obj)
    cfg: EvalAppConfig = obj
    with value_errors_are_user_errors():  # a missing file or dataset, a bad shape: one line, exit 2
        raise_problems(eval_config_problems(cfg))
        suite = _load_suite(cfg)
        rank, world = _process_group(cfg)
    try:
        with value_errors_are_user_errors():
            setup = load_for_eval(cfg)
        what = f"suite {list(suite)}" if suite is not None else f"{len(setup.prompts)} prompts"
        log.info(
            "eval: target %s, drafter %s, %s, block size %d, taps %s, device %s, rank %d of %d",
            setup.target_path,
            setup.drafter_path,
            what,
            setup.block_size,
            setup.layer_ids,
            setup.device,
            rank,
            world,
        )
        if suite is not None:
            reports = _run_suite(cfg, setup, suite, rank, world)
            if rank == 0:
                _write_and_log(
                    cfg,
                    dcfg,
                    Path(run_dir),
                    suite_table(reports, setup.block_size, cfg.max_new_tokens),
                    _suite_json(cfg, setup, reports, world),
                    suite_metrics(reports),
                    {f"eval/{b.name}/accept_len_histogram": b.report for b in reports},
                )
        else:
            report = _run_prompts(cfg, setup, rank, world)
            if report is not None:
                _write_and_log(
                    cfg,
                    dcfg,
                    Path(run_dir),
                    report_table(report),
                    report.to_dict(),
                    report_metrics(report),
                    {"eval/accept_len_histogram": report},
                )
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
