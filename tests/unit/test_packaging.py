"""The torch version is one line across pyproject.toml, the Makefile and the Dockerfile; the image
can compile (Triton builds its launcher with ``cc``); setup, CI and the image install the locked
versions (constraints.txt), pyproject.toml allows the tested transformers minors and no others."""

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


def _range(spec: str, name: str) -> tuple[str, str]:
    """``(lower, upper)`` of a ``name>=lower,<upper`` requirement."""
    m = re.fullmatch(rf"{name}(?:\[\w+\])?>=([0-9.]+),<([0-9.]+)", spec.split("#")[0].strip())
    assert m, f"{spec!r} is not {name}>=X,<Y"
    return m.group(1), m.group(2)


def test_pyproject_allows_exactly_the_tested_minors_and_the_lock_holds_the_newest():
    from dflash.versions import TESTED_MINORS, minor

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = [d for d in project["dependencies"] if d.startswith("transformers")]
    specs += [d for d in project["optional-dependencies"]["dev"] if d.startswith("transformers")]
    tested = TESTED_MINORS["transformers"]
    major, newest = tested[-1].split(".")
    for spec in specs:
        assert _range(spec, "transformers") == (tested[0], f"{major}.{int(newest) + 1}"), spec
    lock = dict(
        line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    assert minor(lock["transformers"]) == tested[-1], "constraints.txt must lock the newest tested minor"
    pinned_torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert f"torch=={lock['torch']}" == pinned_torch.split("#")[0].strip()
    names = [re.split(r"[<>=\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]]
    assert [n for n in names if n not in lock] == [], "every dependency is locked"


def test_setup_ci_and_image_install_the_locked_versions():
    makefile = (REPO / "Makefile").read_text()
    setup = makefile.split("$(BIN)/.installed:", 1)[1].split("\n\n", 1)[0]
    assert (
        setup.count("pip install -q -c constraints.txt") == 2 and "constraints.txt" in setup.splitlines()[0]
    )
    assert "make test" in (REPO / ".ci" / "run").read_text()
    installs = [
        r for r in _run_instructions((REPO / "docker" / "Dockerfile").read_text()) if "pip install" in r
    ]
    assert installs and all("-c constraints.txt" in r for r in installs), installs


def test_an_untested_transformers_is_named_once_with_the_fix(monkeypatch, caplog):
    import logging

    from dflash import versions

    monkeypatch.setattr(versions, "version", lambda name: "5.25.3")
    assert versions.untested_versions() == []
    monkeypatch.setattr(versions, "version", lambda name: "5.26.0")
    (line,) = versions.untested_versions()
    assert "transformers 5.26.0 is installed" in line and "5.24 and 5.25" in line
    assert "pip install -c constraints.txt" in line and "make test-latest TRY=transformers==5.26.0" in line
    monkeypatch.setattr(versions, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="dflash.versions"):
        versions.warn_untested_versions()
        versions.warn_untested_versions()
    assert caplog.text.count("transformers 5.26.0 is installed") == 1
