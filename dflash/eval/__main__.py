"""``python -m dflash.eval``: evaluate an exported DFlash drafter against its target.

    python -m dflash.eval target=tiny drafter_path=/path/to/drafter prompts=/path/to/prompts.jsonl
    python -m dflash.eval target=qwen3_8b drafter_path=out/drafter prompts=gsm8k.jsonl \
        num_prompts=128 max_new_tokens=2048 data.chat_template_kwargs.enable_thinking=false
    torchrun --nproc_per_node=8 -m dflash.eval target=qwen3_8b drafter_path=out/drafter \
        suite=zlab max_samples=128 max_new_tokens=2048        # or suite=gsm8k,mt-bench, data_dir=...

Prints the table (tau, acceptance histogram, TPOT, speedup, lossless), writes ``report.json`` and
``config.yaml`` to the run dir and logs ``eval/*`` to W&B (``logging.mode``). Config:
``conf/eval_app.yaml``, schema ``dflash.eval.config.EvalAppConfig``.
"""

from __future__ import annotations

import sys

from dflash.cli import run_app
from dflash.eval.app import eval_task
from dflash.eval.config import EvalAppConfig, register_eval_schema
from dflash.eval.suites import suite_overrides

register_eval_schema()


def main() -> None:
    sys.argv[1:] = suite_overrides(sys.argv[1:])
    run_app("eval_app", EvalAppConfig, eval_task)


if __name__ == "__main__":
    main()
