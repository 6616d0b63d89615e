"""A built-in math task with LaTeX answers, checked by ``math_verify``.

Three families: adding fractions (``\\frac{1}{2} + \\frac{1}{3}`` -> ``\\frac{5}{6}``), a percentage
of a number (``15\\%`` of 40 -> ``6``) and simplifying a square root (``\\sqrt{12}`` -> ``2\\sqrt{3}``).
The completion is ``\\boxed{answer}``; the reward (``math_verify``) accepts any equivalent form,
so ``\\boxed{0.8333333}`` or ``\\boxed{\\frac{10}{12}}`` count. The base model imitates a noisy
teacher that is right with probability ``teacher_accuracy`` and otherwise off by a little.
Everything is generated on the spot; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from pathlib import Path

import jax
import numpy as np

from relax.models.decoder.transformer import Transformer
from relax.tasks.base import supervised_phase, task_tokenizer, tiny_llama
from relax.text import TextTokenizer

SQUARE_FREE = (2, 3, 5, 6, 7)


@dataclasses.dataclass(frozen=True)
class MathTask:
    """The problems, the noisy teacher and the base model's size and supervised phase."""

    num_train: int = 600
    num_eval: int = 60
    teacher_accuracy: float = 0.4
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    vocab_size: int = 200
    sft_steps: int = 300
    sft_batch: int = 32
    sft_learning_rate: float = 3e-3


def latex(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def fractions_problem(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = rng.randint(1, 5), rng.randint(2, 9), rng.randint(1, 5), rng.randint(2, 9)
    return (
        f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$.",
        latex(Fraction(a, b) + Fraction(c, d)),
    )


def percent_problem(rng: random.Random) -> tuple[str, str]:
    p, n = rng.choice((5, 10, 15, 20, 25, 50, 75)), 4 * rng.randint(1, 30)
    return f"What is ${p}\\%$ of ${n}$?", latex(Fraction(p * n, 100))


def sqrt_problem(rng: random.Random) -> tuple[str, str]:
    k, m = rng.randint(2, 9), rng.choice(SQUARE_FREE)
    return f"Simplify $\\sqrt{{{k * k * m}}}$.", f"{k}\\sqrt{{{m}}}"


FAMILIES = {"fractions": fractions_problem, "percent": percent_problem, "sqrt": sqrt_problem}


def make_splits(task: MathTask) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out problems ``{"prompt", "answer", "data_source"}`` (answer: LaTeX)."""
    rng = random.Random(task.seed)
    seen, rows = set(), []
    for _ in range(100 * (task.num_train + task.num_eval)):
        family = rng.choice(sorted(FAMILIES))
        prompt, answer = FAMILIES[family](rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer, "data_source": f"math/{family}"})
        if len(rows) == task.num_train + task.num_eval:
            break
    return rows[: task.num_train], rows[task.num_train :]


def teacher(task: MathTask):
    """``\\boxed{answer}`` with probability ``teacher_accuracy``, else the answer with one digit changed."""

    def targets(records: list[dict], rng: np.random.Generator) -> list[str]:
        out = []
        for r in records:
            answer = r["answer"]
            if rng.random() >= task.teacher_accuracy:
                digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
                i = digits[int(rng.integers(len(digits)))]
                answer = (
                    answer[:i]
                    + str((int(answer[i]) + int(rng.integers(1, 9))) % 10 or 1)
                    + answer[i + 1 :]
                )
            out.append(f"\\boxed{{{answer}}}")
        return out

    return targets


def build_tokenizer(task: MathTask, directory: Path) -> TextTokenizer:
    train, held_out = make_splits(task)
    texts = [f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in train + held_out]
    return task_tokenizer(texts, directory, vocab_size=task.vocab_size)


def train_base_model(
    task: MathTask, tokenizer: TextTokenizer, train: list[dict], *, key: jax.Array, log=print
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
