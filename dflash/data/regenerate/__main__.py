"""``python -m dflash.data.regenerate``: regenerate every assistant turn with the target.

    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl \
        endpoint=http://127.0.0.1:8000/v1 model=Qwen/Qwen3-8B data.chat_template_kwargs.enable_thinking=false
    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl backend=hf model=/path/to/target

Config: ``conf/regenerate.yaml``, schema ``dflash.data.regenerate.config.RegenerateConfig``.
Re-running the same command resumes the output. Exit status: 0 once every record is in it; 1 some
records failed or the server is down (re-run later); 2 a config or input error, or the server
refused the credentials, URL or model name (HTTP 401/403/404); 75 stopped by SIGTERM, SIGINT or
SIGHUP (re-run to continue). Every ending prints the summary and updates ``<output>.meta.json``.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash.cli import run_app, value_errors_are_user_errors
from dflash.config import UserError
from dflash.data.regenerate.config import RegenerateConfig, register_regenerate_schema

register_regenerate_schema()


def regenerate_task(dcfg: DictConfig, _run_dir: Path) -> int:
    """Regenerate; returns the exit status (module docstring); a refusal of the server is printed
    after the summary as a one-line error."""
    from dflash.data.regenerate.app import run

    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, RegenerateConfig)
    with value_errors_are_user_errors():
        summary = run(cfg)
    if summary.refused is not None and not summary.complete:
        raise UserError(f"the run stopped: {summary.refused}")
    return summary.exit_code


def main() -> None:
    run_app("regenerate", RegenerateConfig, regenerate_task)


if __name__ == "__main__":
    main()
