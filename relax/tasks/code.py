"""A built-in coding task: write a one-line Python function from its docstring, checked by tests.

Prompt (a signature and docstring)::

    def add_7(x):
        \"\"\"Return x plus 7.\"\"\"

Completion: a fenced Python block defining the function; reward: ``code_exec`` (the row's
``tests`` are asserts: the function's calls run in the sandbox, the comparisons in the trainer).
Six families (plus, times, minus, divisible by,
smaller of, larger of) with constants 1..``max_constant``; held-out rows are (family, constant)
pairs never seen in training. The base model imitates a noisy teacher that writes the right
constant with probability ``teacher_accuracy`` and another one otherwise, so GRPO has something
to find. Everything is generated on the spot; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import jax
import numpy as np

from relax.models.decoder.transformer import Transformer
from relax.tasks.base import supervised_phase, task_tokenizer, tiny_llama
from relax.text import TextTokenizer

FAMILIES = {  # name -> (docstring, body, python function of (x, k))
    "add": ("Return x plus {k}.", "x + {k}", lambda x, k: x + k),
    "mul": ("Return x times {k}.", "x * {k}", lambda x, k: x * k),
    "sub": ("Return x minus {k}.", "x - {k}", lambda x, k: x - k),
    "divisible": ("Return True if x is divisible by {k}.", "x % {k} == 0", lambda x, k: x % k == 0),
    "min": ("Return the smaller of x and {k}.", "min(x, {k})", lambda x, k: min(x, k)),
    "max": ("Return the larger of x and {k}.", "max(x, {k})", lambda x, k: max(x, k)),
}


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """The problems, the noisy teacher and the base model's size and supervised phase."""

    max_constant: int = 20
    num_eval: int = 24
    tests_per_problem: int = 4
    teacher_accuracy: float = 0.4
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    vocab_size: int = 320
    sft_steps: int = 300
    sft_batch: int = 32
    sft_learning_rate: float = 3e-3


def solution(family: str, k: int) -> str:
    """The fenced function definition that solves the (family, k) problem."""
    return f"```python\ndef {family}_{k}(x):\n    return {FAMILIES[family][1].format(k=k)}\n```"


def problem(family: str, k: int, rng: random.Random, num_tests: int) -> dict:
    doc, _, fn = FAMILIES[family]
    xs = rng.sample(range(-30, 31), num_tests)
    return {
        "prompt": f'def {family}_{k}(x):\n    """{doc.format(k=k)}"""\n',
        "tests": [f"assert {family}_{k}({x}) == {fn(x, k)!r}" for x in xs],
        "answer": solution(family, k),
        "data_source": f"code/{family}",
    }


def make_splits(task: CodeTask) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out problems ``{"prompt", "tests", "answer", "data_source"}``."""
    rng = random.Random(task.seed)
    pairs = [(f, k) for f in FAMILIES for k in range(1, task.max_constant + 1)]
    rng.shuffle(pairs)
    rows = [problem(f, k, rng, task.tests_per_problem) for f, k in pairs]
    return rows[task.num_eval :], rows[: task.num_eval]


def teacher(task: CodeTask):
    """Right constant with probability ``teacher_accuracy``, else a random other one."""

    def targets(records: list[dict], rng: np.random.Generator) -> list[str]:
        out = []
        for r in records:
            family, k = r["prompt"][4:].split("(")[0].rsplit("_", 1)
            k = int(k)
            written = (
                k
                if rng.random() < task.teacher_accuracy
                else int(rng.integers(1, task.max_constant + 1))
            )
            out.append(
                solution(family, k).replace(
                    FAMILIES[family][1].format(k=k), FAMILIES[family][1].format(k=written)
                )
            )
        return out

    return targets


def build_tokenizer(task: CodeTask, directory: Path) -> TextTokenizer:
    train, held_out = make_splits(task)
    texts = [r["prompt"] + r["answer"] for r in train + held_out]
    return task_tokenizer(texts, directory, vocab_size=task.vocab_size)


def train_base_model(
    task: CodeTask, tokenizer: TextTokenizer, train: list[dict], *, key: jax.Array, log=print
) -> Transformer:
    config = tiny_llama(
        tokenizer, hidden_size=task.hidden_size, num_layers=task.num_layers, max_positions=128
    )
    return supervised_phase(
        config,
        tokenizer,
        train,
        teacher(task),
        steps=task.sft_steps,
        batch=task.sft_batch,
        learning_rate=task.sft_learning_rate,
        seed=task.seed,
        key=key,
        log=log,
    )
