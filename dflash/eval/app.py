"""``python -m dflash.eval``: the app (its schema is :class:`~dflash.eval.config.EvalAppConfig`).

:func:`eval_task` loads everything with
:func:`~dflash.eval.loading.load_for_eval`, runs :func:`~dflash.eval.results.evaluate`, prints the
table, writes ``report.json`` and ``config.yaml`` to the run dir and logs ``eval/*`` to W&B.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash.config import plain_dict
from dflash.eval.config import EvalAppConfig
from dflash.eval.loading import load_for_eval
from dflash.eval.results import EvalReport, evaluate, report_metrics, report_table
from dflash.files import atomic_write

log = logging.getLogger(__name__)


def _histogram_object(report: EvalReport):
    """A wandb.Histogram of the acceptance lengths (bins centred on 1..B)."""
    import numpy as np
    import wandb

    counts = np.array([report.accept_len_hist[k] for k in sorted(report.accept_len_hist)], dtype=np.float64)
    edges = np.arange(0.5, report.block_size + 1.0, 1.0)
    return wandb.Histogram(np_histogram=(counts, edges))


def eval_task(dcfg: Any, run_dir: Path) -> int:
    """What ``python -m dflash.eval`` does: load, evaluate, print the table, write report.json, log W&B."""
    from omegaconf import OmegaConf

    from dflash.config.cli import value_errors_are_user_errors
    from dflash.metrics import WandbLogger, build_logger, progress_bar

    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, EvalAppConfig), type(obj)
    cfg: EvalAppConfig = obj
    with value_errors_are_user_errors():  # a missing file or a bad shape: one line, exit 2
        setup = load_for_eval(cfg)
    log.info(
        "eval: target %s, drafter %s, %d prompts, block size %d, taps %s, device %s",
        setup.target_path,
        setup.drafter_path,
        len(setup.prompts),
        setup.block_size,
        setup.layer_ids,
        setup.device,
    )
    with progress_bar(len(setup.prompts), 0, True, desc="eval") as bar:
        report = evaluate(
            setup.target,
            setup.drafter,
            setup.embed,
            setup.head,
            setup.tokenizer,
            setup.prompts,
            max_new_tokens=cfg.max_new_tokens,
            layer_ids=setup.layer_ids,
            block_size=setup.block_size,
            eos_ids=setup.eos_ids,
            baseline=cfg.baseline,
            warmup=cfg.warmup,
            progress=lambda i, r: bar.update(1) if bar is not None else None,
            verbose=False,
        )
    print(report_table(report), flush=True)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(dcfg, resolve=True))
    atomic_write(run_dir / "report.json", json.dumps(report.to_dict(), indent=1, default=str))
    metrics = report_metrics(report)
    logger = build_logger(cfg.logging, True, run_dir, plain_dict(dcfg), run_name=cfg.name)
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
    print(f"report: {run_dir / 'report.json'}  config: {run_dir / 'config.yaml'}", flush=True)
    return 0
