"""The planner's printed launch command trains the config it planned (issue 32, item 9): the
user's own overrides kept, the recommended split's added, every argument shell-quoted (before:
asked with ``data.token_budget=65536 ... drafter.shard=optimizer``, it printed ``... experiment=
qwen3_6_27b_8gpu topology.num_targets=4 topology.num_drafters=4``: pasted, it trained 16K packets
unsharded)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest
from ranks import run_module
from testpaths import REPO

from dflash.cli import compose_config, hydra_quote
from dflash.config import Config, register_configs, to_config
from dflash.config.checks import free_form_overrides
from dflash.plan.app import plan_config

# torchrun replaced by a function that prints the arguments it got, one JSON list
TORCHRUN_SHIM = f"torchrun() {{ {shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"; }}\n"

ASKED = {
    "the issue's 8-GPU Qwen3.6 plan": [
        "experiment=qwen3_6_27b_8gpu",
        "data.token_budget=65536",
        "topology.num_targets=4",
        "topology.num_drafters=4",
        "drafter.shard=optimizer",
        f"data.path={hydra_quote('/data/my chat=1/ü.jsonl')}",
        "data.chat_template_kwargs.enable_thinking=false",
        "plan.gpu=h200",
    ],
    "one GPU, co-located from a disaggregated experiment": [
        "experiment=qwen3_8b_8gpu",
        "plan.world_size=1",
        "plan.gpu=h200",
        "optim.lr=2e-4",
    ],
    "tensor-parallel replicas": ["experiment=llama3_70b_8gpu", "plan.world_size=8", "plan.gpu=h200"],
}


def printed_launch(asked: list[str]) -> tuple[dict, list[str]]:
    """``python -m dflash.plan <asked>`` (the app: it reads its command line from Hydra): the JSON
    summary and the arguments its printed launch line hands dflash.train, pasted into bash."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = run_module("dflash.plan", asked, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("torchrun ")]
    shell = subprocess.run(["bash", "-c", TORCHRUN_SHIM + line], capture_output=True, text=True, check=True)
    argv = json.loads(shell.stdout)
    assert argv[argv.index("-m") + 1] == "dflash.train"
    return json.loads(proc.stdout.strip().splitlines()[-1]), argv[argv.index("-m") + 2 :]


@pytest.mark.parametrize("name", list(ASKED))
def test_the_printed_command_composes_the_planned_config_with_its_split(name):
    asked = ASKED[name]
    out, train_args = printed_launch(asked)
    register_configs()
    changed = {c.split("=", 1)[0] for c in out["changes"]}  # the planner's changes replace the asked values
    kept = [a for a in free_form_overrides(asked, Config) if a.split("=", 1)[0] not in changed]
    planned = plan_config(compose_config("plan_app", [*kept, *out["changes"]]))
    if not any(a.startswith("data.path=") for a in asked):
        train_args.append(f"data.path={planned.data.path or 'unused'}")
        planned = dataclasses.replace(planned, data=dataclasses.replace(planned.data, path="unused"))
    trained = to_config(compose_config("config", train_args))
    colocated = out["mode"] == "colocated" and out["num_targets"] == 0
    split = dataclasses.replace(
        planned.topology,
        mode="colocated" if colocated else "split",
        num_targets=out["num_targets"],
        num_drafters=None if colocated else out["num_drafters"],
        target_tp=1 if colocated else out["target_tp"],
        drafter_nodes=None,
    )
    want = dataclasses.replace(planned, topology=split, plan=trained.plan)  # plan.* only the planner reads
    assert dataclasses.asdict(trained) == dataclasses.asdict(want)
    assert not any(a.startswith("plan.") for a in train_args)
    if name.startswith("the issue"):
        assert trained.data.token_budget == 65536 and trained.drafter.shard == "optimizer"
        assert trained.data.path == "/data/my chat=1/ü.jsonl"
        assert trained.data.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    "value",
    [
        "outputs/my run=1/ü",
        "plain/run-1.2",
        "it's",
        "a\\b",
        "end\\",
        "x\\'y",
        "${oc.env:HOME}",
        "a\\${x}",
        "a,b",
        "[1,2]",
    ]
    + ["null", "true", "1e3", "5", " lead", "", 'say "hi"', "x#y"],
)
def test_hydra_quote_composes_to_exactly_the_string(value):
    """What dflash.report writes for a run directory given by position: Hydra parses it and
    OmegaConf resolves it back to the very string (no list, sweep, number, null or interpolation)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_override(f"run_dir={hydra_quote(value)}").value()
    assert OmegaConf.create({"run_dir": parsed}).run_dir == value
