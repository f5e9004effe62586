"""The torch version is one line across pyproject.toml, the Makefile and the Dockerfile."""

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
