"""``python -m dflash.data.regenerate``: regenerate every assistant turn with the target.

    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl \
        endpoint=http://127.0.0.1:8000/v1 model=Qwen/Qwen3-8B data.chat_template_kwargs.enable_thinking=false
    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl backend=hf model=/path/to/target

Config: ``conf/regenerate.yaml``, schema ``dflash.data.regenerate.config.RegenerateConfig``.
Re-running the same command resumes the output; the exit status is 0 once every record is in it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash.config.cli import run_app, value_errors_are_user_errors
from dflash.data.regenerate.config import RegenerateConfig, register_regenerate_schema

register_regenerate_schema()


def regenerate_task(dcfg: DictConfig, _run_dir: Path) -> int:
    """Regenerate; exit 0 once every record is in the output (1: some failed, re-run to retry them)."""
    from dflash.data.regenerate.app import run

    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, RegenerateConfig)
    with value_errors_are_user_errors():
        return 0 if run(cfg).complete else 1


def main() -> None:
    run_app("regenerate", RegenerateConfig, regenerate_task)


if __name__ == "__main__":
    main()
