"""The benchmark suites users compare DFlash drafters on: datasets, splits, prompt formats, turns.

The z-lab benchmark (``dflash/benchmark.py`` of z-lab/dflash, its transformers backend) fixes, per
benchmark, the ``datasets`` hub id, config and split, how a row becomes the user turns of one
conversation, and how the turns are decoded:

============  ====================================  =========  =====  ======================================
benchmark     hub id                                config     split  user turns of a row
============  ====================================  =========  =====  ======================================
gsm8k         openai/gsm8k                          main       test   ``question`` + :data:`BOXED`
math500       HuggingFaceH4/MATH-500                -          test   ``problem`` + :data:`BOXED`
humaneval     openai/openai_humaneval               -          test   :data:`HUMANEVAL_PREFIX` + ``prompt``
                                                                      + a closing fence
mbpp          google-research-datasets/mbpp         sanitized  test   ``prompt`` as it is
mt-bench      HuggingFaceH4/mt_bench_prompts        -          train  every string of ``prompt``, in order
============  ====================================  =========  =====  ======================================

- ``max_samples``: when the benchmark has more rows, a seeded shuffle of the row order (Python's
  ``random`` with ``seed``, 0 as in the transformers backend) and its first ``max_samples``;
  otherwise every row in dataset order;
- a conversation's turns are decoded one after another: turn j is the chat template of the user
  turns 1..j with the model's own answers to turns 1..j-1 (the speculative output decoded with
  ``skip_special_tokens``) between them, rendered with ``add_generation_prompt=True`` and the
  template kwargs (``enable_thinking=False`` unless set) and encoded with ``tokenizer.encode``
  (the tokenizer's special tokens added, as the reference does);
- every turn is one result; tau = the mean over turns of each turn's mean acceptance length
  (accepted + 1 per verify step), as the reference reports it.

This module holds the registry (:data:`BENCHMARKS`, :data:`SUITES`), the choice of benchmarks
(:func:`resolve_suite`), the data (:func:`load_benchmark`, :func:`load_suite`: a ``save_to_disk``
copy under ``data_dir`` or the hub) and the rendering (:func:`render_turn`). The decoding is in
:mod:`dflash.eval.suite_run`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.data.chat import render

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
"""What the math benchmarks append to the question."""
HUMANEVAL_PREFIX = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
)


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: where its rows are and how a row becomes user turns."""

    name: str
    hub_id: str
    hub_config: str | None
    split: str
    field: str
    """The column the turns come from (a string, or a list of strings for a multi-turn benchmark)."""
    prefix: str = ""
    suffix: str = ""
    multi_turn: bool = False

    def turns(self, row: dict[str, Any]) -> list[str]:
        """The user turns of one row (ValueError naming the column when it has the wrong shape)."""
        value = row.get(self.field)
        if self.multi_turn:
            if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
                raise ValueError(
                    f"column {self.field!r} must be a non-empty list of strings, got {value!r:.80}"
                )
            return [self.prefix + t + self.suffix for t in value]
        if not isinstance(value, str):
            raise ValueError(f"column {self.field!r} must be a string, got {value!r:.80}")
        return [self.prefix + value + self.suffix]

    def hub_command(self, out: str) -> str:
        """The line that saves this benchmark's copy for ``data_dir`` on a host with internet."""
        args = ", ".join(repr(a) for a in (self.hub_id, self.hub_config) if a is not None)
        return (
            f"python -c \"import datasets; datasets.load_dataset({args}, split='{self.split}')"
            f".save_to_disk('{out}')\""
        )


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("gsm8k", "openai/gsm8k", "main", "test", "question", suffix=BOXED),
        Benchmark("math500", "HuggingFaceH4/MATH-500", None, "test", "problem", suffix=BOXED),
        Benchmark("humaneval", "openai/openai_humaneval", None, "test", "prompt", HUMANEVAL_PREFIX, "\n```"),
        Benchmark("mbpp", "google-research-datasets/mbpp", "sanitized", "test", "prompt"),
        Benchmark("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", multi_turn=True),
    )
}
"""Every known benchmark, in the order suites list them (and the periodic eval lays out its sums)."""

SUITES: dict[str, tuple[str, ...]] = {"zlab": tuple(BENCHMARKS)}
"""Named suites: ``zlab`` = the five benchmarks of the z-lab benchmark."""


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, Sequence):
        return [n for v in value for n in _names(v)]
    return [str(value)]


def resolve_suite(value: Any, field: str = "suite") -> list[str]:
    """The benchmark names of ``value``: a suite name (``zlab``), a benchmark name, a comma-separated
    string or a list of either; duplicates dropped, order kept; [] for None or empty. ValueError
    naming ``field``, the bad value and the choices."""
    out: list[str] = []
    for name in _names(value):
        expanded = SUITES.get(name, (name,))
        bad = [n for n in expanded if n not in BENCHMARKS]
        if bad:
            raise ValueError(
                f"{field}={value!r}: unknown benchmark {bad[0]!r}; use {' or '.join(SUITES)} or a list of "
                f"{', '.join(BENCHMARKS)} (e.g. {field}=[gsm8k,mt-bench])"
            )
        out += [n for n in expanded if n not in out]
    return out


_COMMA_LIST = re.compile(r"^(\+{0,2})((?:eval\.)?suite)=([^\[\]'\"=]+,[^\[\]'\"=]*)$")


def suite_overrides(argv: Sequence[str]) -> list[str]:
    """The command line with ``suite=a,b`` (or ``eval.suite=a,b``) written as the list ``suite=[a,b]``:
    Hydra reads an unquoted comma as a sweep and refuses it outside ``--multirun``."""
    if any(a in ("-m", "--multirun") for a in argv):
        return list(argv)
    out = []
    for arg in argv:
        m = _COMMA_LIST.match(arg)
        out.append(f"{m[1]}{m[2]}=[{m[3]}]" if m else arg)
    return out


def suite_template_kwargs(template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The chat-template kwargs of the suite: ``enable_thinking=False`` (the reference's default)
    unless ``template_kwargs`` sets it."""
    return {"enable_thinking": False, **template_kwargs}


def sample_rows(num_rows: int, max_samples: int | None, seed: int) -> list[int]:
    """The row indices evaluated, in order: all rows, or (``num_rows > max_samples``) the first
    ``max_samples`` of the row order shuffled by ``random.Random(seed)`` (the reference shuffles its
    list of rows with the seeded global ``random``: the same permutation)."""
    rows = list(range(num_rows))
    if max_samples is None or num_rows <= max_samples:
        return rows
    random.Random(seed).shuffle(rows)
    return rows[:max_samples]


@dataclass(frozen=True)
class Conversation:
    """One sampled row of a benchmark: its user turns."""

    sample: int
    """Position among the benchmark's sampled rows (0 = the first evaluated)."""
    row: int
    """Row index in the dataset."""
    turns: list[str]


class BenchmarkDataMissing(ValueError):
    """A benchmark's dataset cannot be read (offline without a ``data_dir`` copy, a missing copy)."""


def _read_rows(bench: Benchmark, data_dir: str | None, field_prefix: str) -> tuple[Any, str]:
    """The benchmark's rows (a ``datasets.Dataset``) and where they came from."""
    import datasets

    if data_dir is not None:
        path = Path(data_dir).expanduser() / bench.name
        fix = f"save it there on a host with internet: {bench.hub_command(str(path))}"
        if not path.is_dir():
            raise BenchmarkDataMissing(
                f"benchmark {bench.name}: {field_prefix}data_dir={data_dir} has no {bench.name}/ copy ({path}); {fix}"
            )
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - datasets raises several types for a bad copy
            raise BenchmarkDataMissing(
                f"benchmark {bench.name}: {path} is not a save_to_disk copy ({type(exc).__name__}: {exc}); {fix}"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if bench.split not in ds:
                raise BenchmarkDataMissing(
                    f"benchmark {bench.name}: {path} has splits {sorted(ds)}, not {bench.split!r}; {fix}"
                )
            ds = ds[bench.split]
        return ds, str(path)
    try:
        ds = datasets.load_dataset(bench.hub_id, bench.hub_config, split=bench.split)
    except Exception as exc:  # noqa: BLE001 - offline, missing, gated: all mean "no data here"
        raise BenchmarkDataMissing(
            f"benchmark {bench.name}: {bench.hub_id} cannot be read from the hub ({type(exc).__name__}: "
            f"{str(exc)[:200]}); on an offline host set {field_prefix}data_dir=<dir> holding a save_to_disk "
            f"copy per benchmark, e.g. {bench.hub_command(f'<dir>/{bench.name}')}"
        ) from None
    where = f"{bench.hub_id}" + (f" ({bench.hub_config})" if bench.hub_config else "") + f" [{bench.split}]"
    return ds, where


def load_benchmark(
    name: str, data_dir: str | None, max_samples: int | None, seed: int, *, field_prefix: str = ""
) -> tuple[list[Conversation], str]:
    """The sampled conversations of benchmark ``name`` and where its data came from.

    Rows come from ``<data_dir>/<name>`` (a ``save_to_disk`` copy) when ``data_dir`` is set, else
    from the hub. :class:`BenchmarkDataMissing` (a ValueError naming the benchmark, the
    ``{field_prefix}data_dir`` setting and the line that saves a copy) when they cannot be read or
    a row lacks the benchmark's column.
    """
    bench = BENCHMARKS[name]
    ds, where = _read_rows(bench, data_dir, field_prefix)
    if bench.field not in ds.column_names:
        raise BenchmarkDataMissing(
            f"benchmark {name}: {where} has columns {ds.column_names}, not {bench.field!r}: not a copy of "
            f"{bench.hub_id}; {bench.hub_command(f'<dir>/{name}')}"
        )
    out = []
    for sample, row in enumerate(sample_rows(len(ds), max_samples, seed)):
        try:
            turns = bench.turns(ds[row])
        except ValueError as exc:
            raise BenchmarkDataMissing(f"benchmark {name}: {where} row {row}: {exc}") from None
        out.append(Conversation(sample=sample, row=row, turns=turns))
    if not out:
        raise BenchmarkDataMissing(f"benchmark {name}: {where} has no rows")
    return out, where


def load_suite(
    value: Any, data_dir: str | None, max_samples: int | None, seed: int, *, field_prefix: str = ""
) -> dict[str, tuple[list[Conversation], str]]:
    """:func:`load_benchmark` of every benchmark of the suite ``value`` (``{field_prefix}suite``), by
    name; {} without a suite. One :class:`BenchmarkDataMissing` naming every benchmark that cannot be
    read (each with its fix), so a config check can call it before any model or process group."""
    names = resolve_suite(value, f"{field_prefix}suite")
    out, missing = {}, []
    for name in names:
        try:
            out[name] = load_benchmark(name, data_dir, max_samples, seed, field_prefix=field_prefix)
        except BenchmarkDataMissing as exc:
            missing.append(str(exc))
    if len(missing) == 1:
        raise BenchmarkDataMissing(missing[0])
    if missing:
        lines = "\n".join(f"  - {m}" for m in missing)
        raise BenchmarkDataMissing(f"{len(missing)} benchmarks cannot be read:\n{lines}")
    return out


def render_turn(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
    """Token ids of the next assistant turn's prompt: the chat template of ``messages`` with the
    generation prompt, encoded as the reference encodes it (``tokenizer.encode``)."""
    text = render(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
    return list(tokenizer.encode(text))


def suite_problems(value: Any, data_dir: str | None, *, field_prefix: str = "") -> list[str]:
    """Config problems of a suite setting, found without reading any dataset: an unknown name, a
    ``data_dir`` that is not a directory or lacks a benchmark's copy. Empty when fine."""
    try:
        names = resolve_suite(value, f"{field_prefix}suite")
    except ValueError as exc:
        return [str(exc)]
    if data_dir is None or not names:
        return []
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        return [
            f"{field_prefix}data_dir={data_dir} is not a directory; set it to a folder holding one save_to_disk "
            f"copy per benchmark ({', '.join(f'<dir>/{n}' for n in names)}), or unset it to read the hub"
        ]
    return [
        f"benchmark {n}: {field_prefix}data_dir={data_dir} has no {n}/ copy; save it there on a host with "
        f"internet: {BENCHMARKS[n].hub_command(str(root / n))}"
        for n in names
        if not (root / n).is_dir()
    ]
