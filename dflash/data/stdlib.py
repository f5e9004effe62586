"""An offline text corpus present on every machine: CPython's own standard-library sources.

The tiny target's tokenizer is trained on it (:func:`stdlib_text_files`); the tiny target's weights
are trained on, and the embedded corpus cuts its prompts from, a small part of it
(:func:`corpus_files`, :func:`code_snippets`), so the embedded default needs no download and the
target's answers to those prompts are real code.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

PROMPT_TEMPLATES = (
    "Continue this code:\n{code}",
    "Complete the following Python code:\n{code}",
    "What comes next in {name}?\n{code}",
    "Here is a snippet from {name}. Continue it.\n{code}",
    "Explain and then continue:\n{code}",
)
CORPUS_FILES = 4
CORPUS_MAX_FILE_BYTES = 16_000
MAX_PROMPT_LINES = 6
"""Prompts of 1-6 lines: under ~130 tokens, so prompt + answer fits the embedded data.max_length."""


def stdlib_text_files(max_files: int = 120) -> list[Path]:
    """Sorted CPython standard-library ``.py`` files: an offline text corpus present everywhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    if not files:
        raise RuntimeError(f"no standard-library sources found under {root}")
    return files[:max_files]


def corpus_files() -> list[Path]:
    """The first CORPUS_FILES standard-library files of at most CORPUS_MAX_FILE_BYTES (~9K tokens):
    small enough for the tiny target to learn in a minute of CPU (a model this size trained that
    long on more varied text still answers in loops of garbled tokens), so that it continues the
    embedded prompts cut from the same files with the code that follows them."""
    return [f for f in stdlib_text_files() if f.stat().st_size <= CORPUS_MAX_FILE_BYTES][:CORPUS_FILES]


def code_snippets(num: int, seed: int, max_answer_lines: int = 0) -> list[tuple[str, str]]:
    """``num`` (user message, continuation) pairs cut from :func:`corpus_files`: 1-MAX_PROMPT_LINES
    consecutive lines of a file in a random template of PROMPT_TEMPLATES, and the lines that follow them up to
    the next blank line, at most ``max_answer_lines`` (0: no continuation). A continuation that
    ends where the code block ends is something a small model can learn to stop at.
    Deterministic for a seed and a Python installation."""
    rng = random.Random(seed)
    files = corpus_files()
    lines_of: dict[Path, list[str]] = {}
    out: list[tuple[str, str]] = []
    while len(out) < num:
        f = rng.choice(files)
        if f not in lines_of:
            lines_of[f] = f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        lines = lines_of[f]
        k = rng.randint(1, MAX_PROMPT_LINES)
        start = rng.randrange(max(1, len(lines) - k))
        code = "".join(lines[start : start + k]).strip("\n")
        answer: list[str] = []
        for line in lines[start + k : start + k + max_answer_lines]:
            if not line.strip():
                break
            answer.append(line)
        if len(code.strip()) < 8 or (max_answer_lines and not answer):
            continue
        out.append(
            (rng.choice(PROMPT_TEMPLATES).format(code=code, name=f.name), "".join(answer).rstrip("\n"))
        )
    return out
