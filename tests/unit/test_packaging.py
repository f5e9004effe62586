"""The torch version is one line across pyproject.toml, the Makefile and the Dockerfile; the image
can compile (Triton builds its launcher with ``cc``)."""

from __future__ import annotations

import re
import tomllib

from testpaths import REPO


def test_one_torch_version_everywhere():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pinned,) = [d for d in deps if re.match(r"torch\b", d)]
    version = re.fullmatch(r"torch==([0-9.]+)", pinned.split("#")[0].strip()).group(1)
    makefile = re.search(r"^TORCH_SPEC \?= torch==([0-9.]+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    docker = re.search(
        r"^ARG TORCH_VERSION=([0-9.]+)$", (REPO / "docker" / "Dockerfile").read_text(), re.M
    ).group(1)
    assert version == makefile == docker, (version, makefile, docker)


def _run_instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's RUN instructions, line continuations joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def test_docker_image_installs_a_c_compiler():
    runs = _run_instructions((REPO / "docker" / "Dockerfile").read_text())
    installs = [r for r in runs if re.search(r"\bapt-get install\b", r)]
    compilers = [r for r in installs if re.search(r"\b(build-essential|gcc)\b", r)]
    assert compilers, f"no RUN apt-get install of build-essential or gcc in docker/Dockerfile: {runs}"
    # before the package: the training job compiles on its first step
    assert runs.index(compilers[0]) < next(i for i, r in enumerate(runs) if "pip install" in r and "-e" in r)
    assert "apt-get update" in compilers[0] and "rm -rf /var/lib/apt/lists" in compilers[0]


def test_run_instructions_join_continuations():
    text = "FROM x\nRUN apt-get update \\\n    && apt-get install -y gcc\nRUN pip install -e .\n"
    assert _run_instructions(text) == ["apt-get update      && apt-get install -y gcc", "pip install -e ."]
