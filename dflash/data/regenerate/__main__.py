"""``python -m dflash.data.regenerate``: regenerate every assistant turn with the target.

    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl \
        endpoint=http://127.0.0.1:8000/v1 model=Qwen/Qwen3-8B chat_template_kwargs.enable_thinking=false
    python -m dflash.data.regenerate input=chat.jsonl output=regen.jsonl backend=hf model=/path/to/target

Config: ``conf/regenerate.yaml``, schema ``dflash.data.regenerate.config.RegenerateConfig``.
Re-running the same command resumes the output; the exit status is 0 once every record is in it.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash.data.regenerate.config import RegenerateConfig, register_regenerate_schema

register_regenerate_schema()


@hydra.main(version_base="1.3", config_path="../../../conf", config_name="regenerate")
def main(dcfg: DictConfig) -> None:
    from dflash.data.regenerate.app import run

    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, RegenerateConfig)
    if not run(cfg).complete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
