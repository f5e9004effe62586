"""Local copies of the z-lab benchmark's datasets for offline tests: a few invented rows per
benchmark in the hub dataset's own columns and types (the reference reads the hub ids of
``dflash.eval.suites.BENCHMARKS``), saved with ``save_to_disk`` as ``<dir>/<benchmark>``.

Rows hold what breaks a careless format: braces, backslashes, quotes, non-ASCII text and code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GSM8K = {
    "question": [
        "A baker fills 3 trays with 12 rolls each and sells {all but 5} of them. How many rolls are sold?",
        "Ana reads 14 pages a day. How many pages does she read in 3 weeks?",
        "A tank holds 240 litres and leaks 1/8 of its water each hour. How much is left after 2 hours?",
        "Tom has $45 and spends 40% on a book. How much money does he have left?",
        "Each of 6 boxes holds 25 pencils. 17 pencils break. How many pencils are whole?",
        "A train covers 180 km in 2.5 hours. What is its average speed in km/h?",
        "Mia saves 3 coins on Monday and doubles the amount each day. How many coins by Friday?",
    ],
    "answer": [
        "3 * 12 = 36; 36 - 5 = 31\n#### 31",
        "14 * 21 = 294\n#### 294",
        "240 * 7/8 * 7/8 = 183.75\n#### 183.75",
        "45 * 0.6 = 27\n#### 27",
        "6 * 25 - 17 = 133\n#### 133",
        "180 / 2.5 = 72\n#### 72",
        "3 + 6 + 12 + 24 + 48 = 93\n#### 93",
    ],
}

MATH500 = {
    "problem": [
        "Compute $\\frac{1}{2} + \\frac{1}{3}$.",
        "Find all real $x$ with $x^2 - 5x + 6 = 0$; write them as $\\{a, b\\}$.",
        "What is the remainder when $2^{10}$ is divided by 7?",
    ],
    "solution": [
        "$\\frac{3}{6} + \\frac{2}{6} = \\boxed{\\frac{5}{6}}$.",
        "$(x-2)(x-3) = 0$, so $\\boxed{\\{2, 3\\}}$.",
        "$2^{10} = 1024 = 7 \\cdot 146 + 2$, so $\\boxed{2}$.",
    ],
    "answer": ["\\frac{5}{6}", "\\{2, 3\\}", "2"],
    "subject": ["Prealgebra", "Algebra", "Number Theory"],
    "level": [1, 2, 3],
    "unique_id": ["test/prealgebra/1.json", "test/algebra/2.json", "test/number_theory/3.json"],
}

HUMANEVAL = {
    "task_id": ["HumanEval/0", "HumanEval/1", "HumanEval/2"],
    "prompt": [
        'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
        "from typing import List\n\n\ndef evens(xs: List[int]) -> List[int]:\n"
        '    """Keep the even numbers of xs, in order: {2, 4} stay."""\n',
        'def shout(s: str) -> str:\n    """Return s upper-cased with a \'!\' appended."""\n',
    ],
    "canonical_solution": [
        "    return a + b\n",
        "    return [x for x in xs if x % 2 == 0]\n",
        "    return s.upper() + '!'\n",
    ],
    "test": [
        "def check(candidate):\n    assert candidate(2, 3) == 5\n",
        "def check(candidate):\n    assert candidate([1, 2, 4]) == [2, 4]\n",
        "def check(candidate):\n    assert candidate('hi') == 'HI!'\n",
    ],
    "entry_point": ["add", "evens", "shout"],
}

MBPP = {
    "source_file": ["Benchmark Questions Verification V2.ipynb"] * 3,
    "task_id": [11, 12, 14],
    "prompt": [
        "Write a python function to remove the first and last occurrence of a given character from the string.",
        "Write a function to sort a given matrix in ascending order according to the sum of its rows.",
        "Write a python function to find the volume of a triangular prism.",
    ],
    "code": [
        "def remove_occ(s, ch):\n    s = s.replace(ch, '', 1)\n    return s[::-1].replace(ch, '', 1)[::-1]\n",
        "def sort_matrix(m):\n    return sorted(m, key=sum)\n",
        "def find_volume(l, b, h):\n    return (l * b * h) / 2\n",
    ],
    "test_imports": [[], [], []],
    "test_list": [
        ['assert remove_occ("hello","l") == "heo"'],
        ["assert sort_matrix([[1, 2, 3], [2, 4, 5], [1, 1, 1]]) == [[1, 1, 1], [1, 2, 3], [2, 4, 5]]"],
        ["assert find_volume(10, 8, 6) == 240"],
    ],
}

MT_BENCH = {
    "prompt": [
        [
            "Write a short travel note about a rainy day in Kyōto.",
            "Rewrite your note so that every sentence starts with the letter R.",
        ],
        [
            "Explain what a Python generator is, with a tiny example.",
            "Now show the same idea with a class that defines __iter__ and __next__.",
        ],
        ["Give three tips for writing clear emails.", "Turn the tips into a haiku."],
    ],
    "prompt_id": [81010001, 81010002, 81010003],
    "category": ["writing", "coding", "writing"],
    "reference": [[], [], []],
}

FIXTURES: dict[str, dict[str, list[Any]]] = {
    "gsm8k": GSM8K,
    "math500": MATH500,
    "humaneval": HUMANEVAL,
    "mbpp": MBPP,
    "mt-bench": MT_BENCH,
}


def save_fixture_datasets(root: Path, names: list[str] | None = None) -> Path:
    """``save_to_disk`` one copy per benchmark under ``root`` (all five by default); returns ``root``."""
    import datasets

    for name in names or list(FIXTURES):
        datasets.Dataset.from_dict(FIXTURES[name]).save_to_disk(str(root / name))
    return root


def export_tiny_drafter(target_dir: Path, out: Path, layer_ids: list[int] | None = None) -> Path:
    """A tiny drafter (tests/tiny_drafter.py) as wide as the target at ``target_dir``, one layer,
    block size 4, random weights (seed 0), exported to ``out``."""
    from tiny_drafter import tiny_arch
    from transformers import AutoConfig

    from dflash.drafter.arch import rope_from_config
    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDraftModel

    c = AutoConfig.from_pretrained(target_dir)
    rope, partial = rope_from_config(c.to_dict())
    arch = tiny_arch(
        hidden_size=c.hidden_size,
        intermediate_size=256,
        num_layers=1,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        target_layer_ids=layer_ids or [1, 2, 4],
        mask_token_id=c.vocab_size - 64,  # the first row past the tokenizer (TinyTargetConfig.extra_vocab)
        rope_parameters=rope,
        partial_rotary_factor=partial,
    )
    model = DFlashDraftModel(arch)
    model.reset_parameters(seed=0)
    return export_drafter(model, out, target_num_layers=c.num_hidden_layers)
