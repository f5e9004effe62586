"""Every command in README.md and docs/*.md still runs, as far as it can be tried without a GPU,
a server or the data it names (a dry run):

- ``python -m dflash.<app> ...`` and ``torchrun ... -m dflash.<app> ...``: the app's config composed
  with the command's overrides exactly as the app would (unknown keys, groups, types, free-form
  keys), into the app's typed schema;
- ``make <target>``: the target exists in the Makefile;
- ``python scripts/<x>.py ...``: the script exists and its ``--help`` runs; ``scripts/*.sh``: the
  file exists and ``bash -n`` parses it; ``sbatch <file>``: the file exists;
- tools of other projects (``vllm``, SGLang, ``docker``, ``huggingface-cli``, ``wandb``, ``pip``,
  shell built-ins) are left to their own docs.

A command with an elided argument (``...``) is composed without it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from testpaths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
APPS = {  # module -> (its conf/ file, the schema, the function that registers it)
    "dflash.train": ("config", "dflash.config:Config", "dflash.config:register_configs"),
    "dflash.plan": ("plan_app", "dflash.config:Config", "dflash.config:register_configs"),
    "dflash.eval": (
        "eval_app",
        "dflash.eval.config:EvalAppConfig",
        "dflash.eval.config:register_eval_schema",
    ),
    "dflash.data.prepare": (
        "prepare",
        "dflash.data.prepare:PrepareConfig",
        "dflash.data.prepare:register_prepare_schema",
    ),
    "dflash.data.regenerate": (
        "regenerate",
        "dflash.data.regenerate.config:RegenerateConfig",
        "dflash.data.regenerate.config:register_regenerate_schema",
    ),
    "dflash.serve_check": (
        "serve_check",
        "dflash.serve_check.config:ServeCheckConfig",
        "dflash.serve_check.config:register_serve_check_schema",
    ),
    "dflash.report": ("report", "dflash.report:ReportAppConfig", "dflash.report:register_report_schema"),
}
EXTERNAL = {
    "vllm",
    "docker",
    "huggingface-cli",
    "wandb",
    "pip",
    "export",
    "cd",
    ".",
    "source",
    "nvidia-smi",
    "git",
}


def shell_commands(path: Path) -> list[tuple[str, int, str]]:
    """``(file, line, command)`` of every command in the file's ```bash blocks (continuations
    joined, comments dropped, ``&&`` chains split)."""
    out = []
    in_block, pending, start = False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            in_block = line.strip() == "```bash"
            continue
        if not in_block:
            continue
        if not pending:
            start = n
        pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if line.rstrip().endswith("\\"):
            continue
        text = " ".join(shlex.split(pending, comments=True))
        pending = ""
        for part in re.split(r"\s&&\s", text):
            if part.strip():
                out.append((path.name, start, part.strip()))
    return out


def every_command() -> list[tuple[str, int, str]]:
    return [c for doc in DOCS for c in shell_commands(doc)]


@cache
def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


@cache
def _script_help(script: str) -> int:
    return subprocess.run(
        [sys.executable, str(REPO / script), "--help"], capture_output=True, timeout=120, cwd=REPO
    ).returncode


def _app_args(tokens: list[str]) -> tuple[str, list[str]] | None:
    """``(module, overrides)`` of a ``python -m`` / ``torchrun -m`` command of a dflash app."""
    if "-m" not in tokens:
        return None
    i = tokens.index("-m")
    module = tokens[i + 1]
    if not module.startswith("dflash."):
        return None
    return module, [a for a in tokens[i + 2 :] if a != "..." and "=" in a and not a.startswith("-")]


def _named(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _compose(module: str, overrides: list[str]) -> None:
    from dflash.cli import compose_config
    from dflash.config import to_config
    from dflash.config.checks import check_known_keys, free_form_overrides, override_key_problems
    from dflash.eval.suites import suite_overrides

    config_name, schema_spec, register = APPS[module]
    schema = _named(schema_spec)
    _named(register)()
    args = free_form_overrides(suite_overrides(overrides), schema)
    args = [a for a in args if not a.startswith("hydra.")]
    assert override_key_problems(args, schema) == []
    dcfg = compose_config(config_name, args)
    check_known_keys(dcfg, schema)
    if schema_spec.endswith(("Config:Config", ":PrepareConfig")) or schema_spec == "dflash.config:Config":
        from omegaconf import OmegaConf

        if OmegaConf.is_missing(dcfg.data, "path"):
            dcfg.data.path = ""
        to_config(dcfg)


def dry_run(command: str) -> str:
    """What was checked of ``command`` (``external`` for another project's tool); raises on a
    command that would not run."""
    tokens = shlex.split(re.sub(r"<[^<>]*>", "X", command))  # placeholders such as <run id>
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # environment assignments
    if not tokens:
        return "environment"
    head = tokens[0]
    if re.match(r"^[a-z_][\w.]*=", head):  # a list of override examples: training's
        _compose("dflash.train", [a for a in tokens if a != "..."])
        return "composed"
    if head == "make":
        targets = [t for t in tokens[1:] if "=" not in t]
        missing = [t for t in targets if t not in _makefile_targets()]
        assert not missing, f"no Makefile target {missing}"
        return "make"
    app = _app_args(tokens)
    if app is not None:
        assert app[0] in APPS, f"{app[0]} is not a dflash app"
        _compose(*app)
        return "composed"
    if head in ("python", "python3") and len(tokens) > 1 and tokens[1].startswith("scripts/"):
        assert (REPO / tokens[1]).is_file(), tokens[1]
        assert _script_help(tokens[1]) == 0, f"{tokens[1]} --help failed"
        return "script"
    if head.startswith("scripts/") and head.endswith(".sh") or head == "sbatch":
        script = REPO / (tokens[1] if head == "sbatch" else head)
        assert script.is_file(), script
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
        return "shell script"
    if head in EXTERNAL or head.startswith(("python", "torchrun")) and "sglang" in command:
        return "external"
    if head in ("python", "python3") and tokens[1:2] == ["-c"]:
        return "external"
    raise AssertionError(f"no rule for this command: {command}")


COMMANDS = every_command()


def test_the_docs_hold_commands():
    assert len(COMMANDS) > 30 and {f for f, _, _ in COMMANDS} >= {"README.md", "training.md", "planner.md"}


@pytest.mark.parametrize("where,command", [(f"{f}:{n}", c) for f, n, c in COMMANDS])
def test_every_documented_command_dry_runs(where, command):
    dry_run(command)


def test_a_broken_command_is_caught():
    with pytest.raises(Exception, match="topology.num_target"):
        dry_run("torchrun --nproc_per_node 8 -m dflash.train topology.num_target=3")
    with pytest.raises(AssertionError, match="no Makefile target"):
        dry_run("make gpu-chek")
    with pytest.raises(Exception):  # noqa: B017 - Hydra's own error for a group that does not exist
        dry_run("python -m dflash.plan experiment=qwen3_9b_8gpu")
