"""What the README and the docs tell a new user holds in the repository (issue 32, item 12).

- every split the docs state next to an experiment name (``experiment=X`` / ```X``` followed by
  ``(a + b)``, ``(a:b)`` or "a target(s) + b drafters") is that experiment's composed topology;
- the README's first screen gives the two commands and says how long ``make test`` takes and where
  ``HF_HUB_OFFLINE=1`` matters; its own-model path runs data -> serve, and its serving command carries
  the chat-template setting the data was made with and the runner flag mixed layouts need;
- no tracked text file cites a path outside the repository (``shared/reference``, ``../shared``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dflash.config.schema import register_configs

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SPLIT = re.compile(
    r"`(?:experiment=)?(?P<name>[a-z0-9_]+)`[^`()]{0,40}?\((?P<a>\d+)\s*(?:\+|:)\s*(?P<b>\d+)\)"
    r"|`(?:experiment=)?(?P<name2>[a-z0-9_]+)`\s+is\s+(?P<a2>\d+)\s+targets?\s+\+\s+(?P<b2>\d+)\s+drafters?"
)


def _experiments() -> set[str]:
    return {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}


def _split(name: str) -> tuple[int, int]:
    register_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={name}"])
    return int(cfg.topology.num_targets), int(cfg.topology.num_drafters)


def _stated_splits() -> list[tuple[str, str, tuple[int, int]]]:
    found = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())  # statements wrap across lines
        for m in SPLIT.finditer(text):
            name = m.group("name") or m.group("name2")
            a, b = (m.group("a"), m.group("b")) if m.group("name") else (m.group("a2"), m.group("b2"))
            if name in _experiments():
                found.append((doc.name, name, (int(a), int(b))))
    return found


def test_the_docs_state_splits():
    named = {name for _, name, _ in _stated_splits()}
    assert {"qwen3_8b_8gpu", "qwen3_6_27b_8gpu"} <= named, named


@pytest.mark.parametrize("doc,name,split", _stated_splits(), ids=lambda v: str(v))
def test_every_stated_split_is_the_experiments(doc, name, split):
    assert _split(name) == split, f"{doc} says {name} is {split[0]} + {split[1]}"


def test_the_readme_first_screen_and_serving():
    readme = (REPO / "README.md").read_text()
    first = readme[: readme.index("## Where things are")]
    assert "make demo" in first and "make test" in first
    assert re.search(r"make test.*\d+(-\d+)? min on 2 cores", first), "make test's duration"
    assert "HF_HUB_OFFLINE=1" in first
    own = readme[readme.index("## Your own model") : readme.index("## Overrides")]
    steps = [
        "dflash.data.regenerate",
        "dflash.data.prepare",
        "dflash.plan",
        "dflash.train",
        "dflash.eval",
        "vllm serve",
    ]
    at = [own.rindex(s) for s in steps]  # the last "vllm serve" serves the drafter (the first, the target)
    assert at == sorted(at), at
    serve = own[own.rindex("vllm serve") :]
    assert "--default-chat-template-kwargs '{\"enable_thinking\": false}'" in serve
    assert '"method": "dflash"' in serve and "VLLM_USE_V2_MODEL_RUNNER=1" in own
    assert "flash-linear-attention" in readme and "causal-conv1d" in readme


def test_no_tracked_file_cites_a_path_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    me = Path(__file__).relative_to(REPO).as_posix()
    cited = []
    for rel in tracked.split():
        path = REPO / rel
        if (
            rel == me
            or path.suffix not in {".py", ".md", ".yaml", ".toml", ".sh", ".txt", ""}
            or not path.is_file()
        ):
            continue
        text = path.read_text(errors="ignore")
        cited += [f"{rel}: {m}" for m in re.findall(r"\S*(?:shared/reference|\.\./shared)\S*", text)]
    assert not cited, cited
