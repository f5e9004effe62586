"""``python -m dflash.serve_check`` (``make serve-check``): the exported drafter decoded by real vLLM.

    python -m dflash.serve_check                          # the default run (trained once, cached)
    python -m dflash.serve_check run_dir=outputs/tiny_cpu/<run id>   # a run of your own (tiny target)
    python -m dflash.serve_check regenerate=false corrupt=[]         # the decode comparison alone

Config: ``conf/serve_check.yaml``, schema ``dflash.serve_check.config.ServeCheckConfig``. Exit code 0
when every verdict passed, 1 when one failed (the table says which), 2 for a config error.
"""

from __future__ import annotations

from dflash.cli import run_app
from dflash.serve_check.app import serve_check_task
from dflash.serve_check.config import ServeCheckConfig, register_serve_check_schema

register_serve_check_schema()


def main() -> None:
    run_app("serve_check", ServeCheckConfig, serve_check_task)


if __name__ == "__main__":
    main()
