"""``python -m dflash.eval``: evaluate an exported DFlash drafter against its target.

    python -m dflash.eval target=tiny drafter_path=/path/to/drafter prompts=/path/to/prompts.jsonl
    python -m dflash.eval target=qwen3_8b drafter_path=out/drafter prompts=gsm8k.jsonl \
        num_prompts=128 max_new_tokens=2048 chat_template_kwargs.enable_thinking=false

Prints the table (tau, acceptance histogram, TPOT, speedup, lossless), writes ``report.json`` and
``config.yaml`` to the run dir and logs ``eval/*`` to W&B (``logging.mode``). Config:
``conf/eval_app.yaml``, schema ``dflash.eval.app.EvalAppConfig``.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dflash.eval.app import register_eval_schema, run_app

register_eval_schema()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="eval_app")
def main(dcfg: DictConfig) -> None:
    run_app(dcfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
