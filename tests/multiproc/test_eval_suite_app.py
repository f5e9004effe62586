"""``python -m dflash.eval suite=...`` end to end on local fixture datasets (tests/suite_fixtures.py)
with the tiny target and a tiny drafter: the table, report.json and offline W&B; a missing dataset
is one line and exit 2; 2 gloo ranks give the single process's results. The app runs as processes
forked from tests/ranks.py's forkserver (``run_module``; the 2 ranks with torchrun's environment)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ranks import Completed, run_module
from suite_fixtures import GSM8K, MT_BENCH, export_tiny_drafter, save_fixture_datasets
from testpaths import REPO
from wandb_reader import read_wandb_run

from dflash.eval.suites import BOXED

pytestmark = pytest.mark.multiproc

FIVE = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return save_fixture_datasets(tmp_path_factory.mktemp("suite_app_data"))


@pytest.fixture(scope="module")
def drafter_dir(tiny_target_dir, tmp_path_factory) -> Path:
    return export_tiny_drafter(tiny_target_dir, tmp_path_factory.mktemp("suite_app_drafter") / "drafter")


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _args(tiny_target_dir, drafter_dir, run_dir, *extra) -> list[str]:
    return [
        f"target.path={tiny_target_dir}",
        "target.tiny=null",
        f"drafter_path={drafter_dir}",
        "max_new_tokens=10",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _eval(args: list[str], cwd: Path, nproc: int = 1) -> Completed:
    """``python -m dflash.eval <args>``; ``nproc`` > 1: as that many torchrun ranks."""
    return run_module("dflash.eval", args, env=_env(), cwd=cwd, timeout=240, nproc=nproc)


@pytest.fixture(scope="module")
def zlab_run(tiny_target_dir, drafter_dir, data_dir, tmp_path_factory) -> Path:
    """``suite=zlab`` in one process, logged to offline W&B."""
    run_dir = tmp_path_factory.mktemp("zlab") / "run"
    extra = [f"data_dir={data_dir}", "suite=zlab", "max_samples=4", "logging.mode=offline", "step=3"]
    proc = _eval(_args(tiny_target_dir, drafter_dir, run_dir, *extra), run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir / "stdout.txt").write_text(proc.stdout)
    return run_dir


def test_suite_zlab_end_to_end_writes_the_table_report_and_wandb(zlab_run):
    stdout = (zlab_run / "stdout.txt").read_text()
    assert "DFlash suite: block size 4, max_new_tokens 10" in stdout
    for name in FIVE:
        assert any(line.startswith(f"{name} ") for line in stdout.splitlines()), name
    report = json.loads((zlab_run / "report.json").read_text())
    assert report["suite"] == FIVE and report["num_ranks"] == 1 and report["max_samples"] == 4
    assert report["template_kwargs"] == {"enable_thinking": False}
    benches = report["benchmarks"]
    assert [benches[n]["num_samples"] for n in FIVE] == [4, 3, 3, 3, 3]  # gsm8k's 7 rows sampled down to 4
    assert benches["mt-bench"]["num_turns"] == 6
    assert benches["mt-bench"]["first_prompt"] == MT_BENCH["prompt"][0][0]
    first_gsm8k_row = benches["gsm8k"]["turns"][0]["row"]
    assert benches["gsm8k"]["first_prompt"] == GSM8K["question"][first_gsm8k_row] + BOXED
    run = read_wandb_run(zlab_run)
    (row,) = run.history
    assert row["train/step"] == 3
    for name in FIVE:
        b = benches[name]
        assert b["lossless"] is True and b["tau"] >= 1
        results = b["report"]["results"]
        turn_taus = [
            sum(r["accept_lengths"]) / len(r["accept_lengths"]) for r in results if r["accept_lengths"]
        ]
        assert b["tau"] == pytest.approx(sum(turn_taus) / len(turn_taus))
        assert sum(b["accept_len_hist"].values()) == sum(len(r["accept_lengths"]) for r in results)
        assert row[f"eval/{name}/tau"] == pytest.approx(b["tau"])
        assert row[f"eval/{name}/tau_pooled"] == pytest.approx(b["tau_pooled"])
        assert [row[f"eval/{name}/accept_len_hist/{k}"] for k in range(1, 5)] == [
            b["accept_len_hist"][str(k)] for k in range(1, 5)
        ]
        assert row[f"eval/{name}/accept_len_histogram/_type"] == "histogram"
    assert "eval/tau" not in row  # the suite logs per benchmark only


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_give_the_single_process_results(
    zlab_run, tiny_target_dir, drafter_dir, data_dir, tmp_path
):
    """Rank r decodes conversations r, r + 2, ...; rank 0 gathers and reports: every turn's output
    and acceptance lengths equal the single process's."""
    run_dir = tmp_path / "run"
    extra = [f"data_dir={data_dir}", "suite=gsm8k,mt-bench", "max_samples=4", "logging.mode=disabled"]
    proc = _eval(_args(tiny_target_dir, drafter_dir, run_dir, *extra), tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("DFlash suite:") == 1  # rank 0 alone reports
    two = json.loads((run_dir / "report.json").read_text())
    one = json.loads((zlab_run / "report.json").read_text())
    assert two["num_ranks"] == 2 and two["suite"] == ["gsm8k", "mt-bench"]
    for name in two["suite"]:
        a, b = one["benchmarks"][name], two["benchmarks"][name]
        assert b["turns"] == a["turns"] and b["first_prompt"] == a["first_prompt"]
        key = [(r["output_ids"], r["accept_lengths"], r["prompt_len"]) for r in a["report"]["results"]]
        assert [
            (r["output_ids"], r["accept_lengths"], r["prompt_len"]) for r in b["report"]["results"]
        ] == key
        assert b["tau"] == a["tau"] and b["accept_len_hist"] == a["accept_len_hist"]


def test_a_missing_dataset_is_one_error_and_exit_2(tiny_target_dir, drafter_dir, tmp_path):
    """Offline, no data_dir copy: the error names each benchmark, data_dir and the line that saves a copy
    (a data_dir lacking one benchmark is a config problem, tests/unit/test_eval_suites.py)."""
    extra = ["suite=gsm8k,mt-bench", "logging.mode=disabled"]
    proc = _eval(_args(tiny_target_dir, drafter_dir, tmp_path / "run", *extra), tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dflash: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0] == "dflash: error: 2 benchmarks cannot be read:"  # every missing one, at once
    for name, hub_id in (("gsm8k", "openai/gsm8k"), ("mt-bench", "HuggingFaceH4/mt_bench_prompts")):
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"  - benchmark {name}: ")]
        assert f"{hub_id} cannot be read from the hub" in line and "set data_dir=<dir>" in line
        assert f"save_to_disk('<dir>/{name}')" in line
    assert not (tmp_path / "run" / "report.json").exists()
