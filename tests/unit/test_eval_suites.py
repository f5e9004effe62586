"""The z-lab benchmark suite (dflash.eval.suites / suite_run): the rendered prompts string for string
against the reference's formats, its seeded sample, the chat template, multi-turn MT-Bench, the
errors, and the same suite from the training loop's periodic eval.

The datasets are local copies in each hub dataset's schema (tests/suite_fixtures.py); the expected
strings below are written from what z-lab/dflash ``benchmark.py`` does with a row (its DATASETS
table): ``"{question}\\nPlease reason step by step, and put your final answer within \\\\boxed{{}}."``
for gsm8k, the same with ``{problem}`` for math500, ``"Write a solution to the following problem and
make sure that it passes the tests:\\n```python\\n{prompt}\\n```"`` for humaneval, ``prompt`` as it
is for mbpp and each string of ``prompt`` as one turn for mt-bench.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from suite_fixtures import (
    FIXTURES,
    GSM8K,
    HUMANEVAL,
    MATH500,
    MBPP,
    MT_BENCH,
    export_tiny_drafter,
    save_fixture_datasets,
)

from dflash.cli import compose_config
from dflash.drafter.model import DFlashDraftModel
from dflash.eval.config import EvalAppConfig, register_eval_schema
from dflash.eval.loading import eval_config_problems
from dflash.eval.suites import (
    BENCHMARKS,
    BenchmarkDataMissing,
    load_benchmark,
    load_suite,
    render_turn,
    resolve_suite,
    sample_rows,
    suite_overrides,
    suite_problems,
    suite_template_kwargs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FIVE = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# The reference's format of each benchmark, as str.format templates on a row (mt-bench: the list itself).
REFERENCE_FORMATS = {
    "gsm8k": "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "math500": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "humaneval": "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```",
    "mbpp": "{prompt}",
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return save_fixture_datasets(tmp_path_factory.mktemp("suite_data"))


@pytest.fixture(scope="module")
def drafter_dir(tiny_target_dir, tmp_path_factory) -> Path:
    return export_tiny_drafter(tiny_target_dir, tmp_path_factory.mktemp("suite_drafter") / "drafter")


def _rows(columns: dict[str, list]) -> list[dict]:
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


# ------------------------------------------------------------------------------ prompts


def test_every_benchmark_renders_the_reference_prompts(data_dir):
    literal = {  # the first row of each fixture, written out
        "gsm8k": "A baker fills 3 trays with 12 rolls each and sells {all but 5} of them. How many rolls are "
        "sold?\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "math500": "Compute $\\frac{1}{2} + \\frac{1}{3}$.\nPlease reason step by step, and put your final "
        "answer within \\boxed{}.",
        "humaneval": "Write a solution to the following problem and make sure that it passes the tests:\n"
        '```python\ndef add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n'
        '    5\n    """\n\n```',
        "mbpp": "Write a python function to remove the first and last occurrence of a given character from "
        "the string.",
    }
    for name, fmt in REFERENCE_FORMATS.items():
        convs, where = load_benchmark(name, str(data_dir), None, 0)
        assert where == str(data_dir / name)
        assert [c.row for c in convs] == list(range(len(_rows(FIXTURES[name]))))  # every row, in order
        assert [c.turns for c in convs] == [[fmt.format(**row)] for row in _rows(FIXTURES[name])], name
        assert convs[0].turns[0] == literal[name]
    assert BOXED in load_benchmark("gsm8k", str(data_dir), None, 0)[0][1].turns[0]
    mt, _ = load_benchmark("mt-bench", str(data_dir), None, 0)
    assert [c.turns for c in mt] == MT_BENCH["prompt"]  # every turn, as it is, in order
    assert mt[0].turns == [
        "Write a short travel note about a rainy day in Kyōto.",
        "Rewrite your note so that every sentence starts with the letter R.",
    ]


def test_the_registry_names_the_reference_datasets():
    got = {n: (b.hub_id, b.hub_config, b.split, b.field, b.multi_turn) for n, b in BENCHMARKS.items()}
    assert got == {
        "gsm8k": ("openai/gsm8k", "main", "test", "question", False),
        "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", False),
        "humaneval": ("openai/openai_humaneval", None, "test", "prompt", False),
        "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt", False),
        "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", True),
    }
    # every fixture has the columns of its hub dataset
    assert set(GSM8K) == {"question", "answer"}
    assert set(MATH500) == {"problem", "solution", "answer", "subject", "level", "unique_id"}
    assert set(HUMANEVAL) == {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    assert set(MBPP) == {"source_file", "task_id", "prompt", "code", "test_imports", "test_list"}
    assert set(MT_BENCH) == {"prompt", "prompt_id", "category", "reference"}


@pytest.mark.parametrize("seed", [0, 42])
def test_max_samples_draws_the_reference_sample(data_dir, seed):
    """The reference shuffles its list of rows with the seeded global ``random`` and keeps the head."""
    state = random.getstate()
    try:
        rows = [{"turns": [REFERENCE_FORMATS["gsm8k"].format(**r)]} for r in _rows(GSM8K)]
        random.seed(seed)
        random.shuffle(rows)
        expected = [r["turns"] for r in rows[:3]]
    finally:
        random.setstate(state)
    convs, _ = load_benchmark("gsm8k", str(data_dir), 3, seed)
    assert [c.turns for c in convs] == expected
    assert [c.sample for c in convs] == [0, 1, 2] and [c.row for c in convs] != [0, 1, 2]
    assert sample_rows(7, 7, seed) == sample_rows(7, None, seed) == sample_rows(7, 50, seed) == list(range(7))
    assert sample_rows(7, 3, 0) != sample_rows(7, 3, 42)


def test_turns_go_through_the_chat_template_as_the_reference(tiny_target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    kwargs = suite_template_kwargs({})
    assert kwargs == {"enable_thinking": False}
    assert suite_template_kwargs({"enable_thinking": True, "x": 1}) == {"enable_thinking": True, "x": 1}
    messages = [
        {"role": "user", "content": "Compute 2+2.\nPlease reason"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    ids = render_turn(tok, messages, kwargs)
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert ids == tok.encode(text)
    assert tok.decode(ids) == (
        "<|im_start|>user\nCompute 2+2.\nPlease reason<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )


# ------------------------------------------------------------------------------ names, errors


def test_suite_names_and_the_comma_form_on_the_command_line():
    five = FIVE
    assert resolve_suite("zlab") == five and resolve_suite(None) == [] and resolve_suite([]) == []
    assert resolve_suite("gsm8k,mt-bench") == ["gsm8k", "mt-bench"]
    assert resolve_suite(["mt-bench", "zlab", "gsm8k"]) == [
        "mt-bench",
        "gsm8k",
        "math500",
        "humaneval",
        "mbpp",
    ]
    with pytest.raises(
        ValueError, match=r"eval.suite='gsm8k,aime': unknown benchmark 'aime'; use zlab or a list"
    ):
        resolve_suite("gsm8k,aime", "eval.suite")
    argv = ["suite=gsm8k,mt-bench", "eval.suite=gsm8k,mbpp", "suite=zlab", "suite=[a,b]", "x=a,b"]
    assert suite_overrides(argv) == ["suite=[gsm8k,mt-bench]", "eval.suite=[gsm8k,mbpp]", *argv[2:]]
    assert suite_overrides(["-m", "suite=gsm8k,mbpp"]) == ["-m", "suite=gsm8k,mbpp"]  # a sweep stays one
    from omegaconf import OmegaConf

    register_eval_schema()
    for override, names in (("suite=zlab", five), ("suite=[gsm8k,mt-bench]", ["gsm8k", "mt-bench"])):
        cfg = OmegaConf.to_object(compose_config("eval_app", ["drafter_path=x", override]))
        assert isinstance(cfg, EvalAppConfig) and resolve_suite(cfg.suite) == names
        assert eval_config_problems(cfg) == []

    def problems(*overrides: str) -> list[str]:
        return eval_config_problems(
            OmegaConf.to_object(compose_config("eval_app", ["drafter_path=x", *overrides]))
        )

    (both,) = problems("suite=gsm8k", "prompts=p.jsonl")
    assert both.startswith("prompts='p.jsonl' and suite='gsm8k': set exactly one")
    assert problems() == ["prompts=None and suite=None: " + both.split(": ", 1)[1]]
    # an empty prompts= (it read whatever the working directory held) is refused
    assert problems("prompts=''") == [
        "prompts='': name a prompts file (prompts=<prompts.jsonl> or a datasets path), or use suite=zlab"
    ]
    assert problems("suite=gsm8k", "max_samples=0") == [
        "max_samples=0: must be >= 1 or null (every row of each benchmark)"
    ]
    (bad,) = problems("suite=[gsm8k,aime]")
    assert "unknown benchmark 'aime'" in bad


def test_missing_data_is_one_error_naming_the_benchmark_and_the_fix(tmp_path, data_dir):
    # offline (tests run with HF_DATASETS_OFFLINE=1) and no data_dir: the hub cannot be read
    with pytest.raises(BenchmarkDataMissing) as err:
        load_benchmark("gsm8k", None, 4, 0, field_prefix="eval.")
    msg = str(err.value)
    assert msg.startswith("benchmark gsm8k: openai/gsm8k cannot be read from the hub")
    assert "set eval.data_dir=<dir>" in msg and "load_dataset('openai/gsm8k', 'main', split='test')" in msg
    partial = save_fixture_datasets(tmp_path / "partial", ["gsm8k"])
    with pytest.raises(BenchmarkDataMissing, match=r"benchmark mbpp: data_dir=.* has no mbpp/ copy"):
        load_benchmark("mbpp", str(partial), None, 0)
    problems = suite_problems("zlab", str(partial))
    assert [p.split(":")[0] for p in problems] == [
        f"benchmark {n}" for n in ("math500", "humaneval", "mbpp", "mt-bench")
    ]
    assert "save_to_disk('" + str(partial / "mt-bench") + "')" in problems[-1]
    assert suite_problems("zlab", str(data_dir)) == [] and suite_problems(None, "/nowhere") == []
    with pytest.raises(BenchmarkDataMissing, match=r"^4 benchmarks cannot be read:\n  - benchmark math500: "):
        load_suite("zlab", str(partial), None, 0)
    assert load_suite(None, None, None, 0) == {} and list(load_suite("zlab", str(data_dir), 2, 0)) == FIVE
    assert "is not a directory" in suite_problems("gsm8k", str(tmp_path / "nowhere"))[0]
    import datasets

    datasets.Dataset.from_dict({"text": ["hi"]}).save_to_disk(str(tmp_path / "wrong" / "math500"))
    with pytest.raises(BenchmarkDataMissing, match=r"has columns \['text'\], not 'problem'"):
        load_benchmark("math500", str(tmp_path / "wrong"), None, 0)
    datasets.Dataset.from_dict({"prompt": ["one turn, not a list"]}).save_to_disk(
        str(tmp_path / "bad" / "mt-bench")
    )
    with pytest.raises(
        BenchmarkDataMissing, match=r"row 0: column 'prompt' must be a non-empty list of strings"
    ):
        load_benchmark("mt-bench", str(tmp_path / "bad"), None, 0)


# ------------------------------------------------------------------------------ decoding


def _setup(tiny_target_dir, drafter_dir, data_dir, *extra):
    from omegaconf import OmegaConf

    from dflash.eval.loading import load_for_eval

    register_eval_schema()
    cfg = OmegaConf.to_object(
        compose_config(
            "eval_app",
            [
                f"target.path={tiny_target_dir}",
                "target.tiny=null",
                f"drafter_path={drafter_dir}",
                "suite=mt-bench",
                f"data_dir={data_dir}",
                "max_new_tokens=10",
                *extra,
            ],
        )
    )
    return cfg, load_for_eval(cfg)


def test_mt_bench_turns_carry_the_model_answer_into_the_next_turn(tiny_target_dir, drafter_dir, data_dir):
    from dflash.eval.app import _decoder
    from dflash.eval.suite_run import benchmark_report, decode_conversations

    cfg, setup = _setup(tiny_target_dir, drafter_dir, data_dir)
    assert setup.prompts == [] and setup.block_size == 4
    dec = _decoder(cfg, setup, suite_template_kwargs({}))
    convs, _ = load_benchmark("mt-bench", str(data_dir), None, 0)
    turns = decode_conversations(dec, "mt-bench", convs[:2])
    assert [(t.sample, t.turn) for t in turns] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tok = setup.tokenizer
    first, second = turns[0], turns[1]
    assert first.answer == tok.decode(first.result.output_ids, skip_special_tokens=True) and first.answer
    history = [
        {"role": "user", "content": convs[0].turns[0]},
        {"role": "assistant", "content": first.answer},
        {"role": "user", "content": convs[0].turns[1]},
    ]
    ids = render_turn(tok, history, suite_template_kwargs({}))
    assert second.result.prompt_len == len(ids)
    again = dec.decode(ids)  # the same prompt decoded on its own gives the same answer
    assert (
        again.output_ids == second.result.output_ids and again.accept_lengths == second.result.accept_lengths
    )
    assert all(t.result.matches for t in turns)  # lossless against the block-size-1 baseline

    rep = benchmark_report("mt-bench", "fixture", list(reversed(turns)), 4, 10)
    assert [(t.sample, t.turn) for t in rep.turns] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.index for r in rep.report.results] == [0, 1, 2, 3]
    taus = [t.result.tau for t in turns]
    assert rep.tau == pytest.approx(sum(taus) / 4)  # the mean of each turn's mean, as the reference
    steps = [a for t in turns for a in t.result.accept_lengths]
    assert rep.report.tau == pytest.approx(sum(steps) / len(steps))
    d = rep.to_dict()
    assert d["first_prompt"] == MT_BENCH["prompt"][0][0] and d["num_samples"] == 2 and d["num_turns"] == 4
    assert sum(d["accept_len_hist"].values()) == len(steps) and d["lossless"] is True


def test_a_turn_past_the_target_context_is_refused(tiny_target_dir, drafter_dir, data_dir):
    from dflash.eval.app import _decoder
    from dflash.eval.suite_run import decode_conversations

    cfg, setup = _setup(tiny_target_dir, drafter_dir, data_dir)
    dec = _decoder(cfg, setup, {})
    dec.max_positions = 30
    convs, _ = load_benchmark("mt-bench", str(data_dir), None, 0)
    with pytest.raises(
        ValueError, match=r"benchmark mt-bench row 0 turn 1: a \d+-token prompt .* max_position_embeddings=30"
    ):
        decode_conversations(dec, "mt-bench", convs[:1])


# ------------------------------------------------------------------------------ the training loop


def test_periodic_eval_logs_every_benchmark_of_the_suite(tiny_target_dir, drafter_dir, data_dir, tmp_path):
    """eval.suite in a training config: eval/<bench>/tau and its histogram from PeriodicEval; two
    drafters' shares add up to one drafter's whole (the counts and taus are equal)."""
    from dflash.config import register_configs, to_config
    from dflash.targets.loader import load_embed_and_head
    from dflash.train.periodic_eval import EVAL_SUMS, PeriodicEval, eval_metrics
    from dflash.train.setup import prepare

    conversations = tmp_path / "chat.jsonl"
    with open(conversations, "w") as f:
        for q in ["def foo(x):", "import os", "class A:"] * 2:
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": f"{q} pass"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    register_configs()
    overrides = [
        f"target.path={tiny_target_dir}",
        "target.tiny=null",
        f"data.path={conversations}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "data.num_eval_prompts=2",
        "data.max_length=64",
        "data.token_budget=256",
        "drafter.block_size=4",
        "drafter.num_layers=1",
        "eval.every=1",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.suite=[gsm8k,mt-bench]",
        f"eval.data_dir={data_dir}",
        "eval.max_samples=3",
    ]
    cfg = to_config(compose_config("config", overrides))
    run = prepare(cfg, 3)
    drafter = DFlashDraftModel(run.arch)
    drafter.reset_parameters(seed=0)
    embed, head = load_embed_and_head(run.target_path)
    whole = PeriodicEval(cfg, run, torch.device("cpu"))
    assert {n: len(c) for n, c in whole.suite.items()} == {"gsm8k": 3, "mt-bench": 3}
    sums = whole.run(drafter, embed, head)
    m = eval_metrics(sums, 4)
    assert m["eval/tau"] >= 1 and math.isfinite(m["eval/tau_hat"])
    assert {k.split("/")[1] for k in m if k.count("/") >= 2} == {"gsm8k", "mt-bench", "accept_len_hist"}
    assert m["eval/gsm8k/num_samples"] == 3 and m["eval/gsm8k/num_prompts"] == 3
    assert m["eval/mt-bench/num_samples"] == 3 and m["eval/mt-bench/num_prompts"] == 6  # two turns each
    for bench in ("gsm8k", "mt-bench"):
        hist = [m[f"eval/{bench}/accept_len_hist/{k}"] for k in range(1, 5)]
        assert sum(hist) == m[f"eval/{bench}/num_steps"] > 0
        pooled = sum(k * c for k, c in enumerate(hist, start=1)) / sum(hist)
        assert m[f"eval/{bench}/tau_pooled"] == pytest.approx(pooled) and m[f"eval/{bench}/tau"] >= 1
    shares = [PeriodicEval(cfg, run, torch.device("cpu"), drafter_index=i, num_drafters=2) for i in (0, 1)]
    assert [len(s.suite["gsm8k"]) for s in shares] == [2, 1]
    split = eval_metrics(sum(s.run(drafter, embed, head) for s in shares), 4)
    exact = [k for k in m if "tpot" not in k]
    assert {k: split[k] for k in exact} == pytest.approx({k: m[k] for k in exact})
    aborted = whole.run(drafter, embed, head, should_stop=lambda: True)
    assert aborted[EVAL_SUMS.index("aborted")] == 1 and eval_metrics(aborted, 4) == {}
    spent = whole.run(drafter, embed, head, budget_s=0.0)  # eval.max_share: no time left, nothing decoded
    assert spent[EVAL_SUMS.index("cut_short")] == 1 and spent[EVAL_SUMS.index("steps")] == 0
    assert eval_metrics(spent, 4) == {} and m["eval/cut_short"] == 0
