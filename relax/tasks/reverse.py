"""A built-in verifiable task: reverse a short string of letters.

Prompt ``"cabd="``, correct answer ``"dbac"``, reward = exact match. The base model is a tiny
Llama taught by a short supervised phase to imitate a *noisy teacher* that reverses the string
only ``reverse_prob`` of the time and otherwise copies it. The base model therefore knows both
behaviours but prefers the wrong one (greedy decoding copies); GRPO with the exact-match reward
must find and reinforce the right one. Held-out prompts are strings never seen in training.
Everything (data, tokenizer, model) is generated on the spot; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import jax
import numpy as np

from relax.models.config.model import ModelConfig
from relax.models.decoder.transformer import Transformer
from relax.tasks.base import supervised_phase, tiny_llama, write_jsonl
from relax.text import TextTokenizer, load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    """The task, its noisy teacher, the base model's size and its supervised phase."""

    alphabet: str = "abcdefgh"
    min_len: int = 3
    max_len: int = 5
    reverse_prob: float = 0.3
    num_train: int = 4000
    num_eval: int = 200
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_experts: int = (
        0  # > 0: the base model is a tiny mixture of experts (relax.tasks.base.tiny_llama)
    )
    sft_steps: int = 400
    sft_batch: int = 64
    sft_learning_rate: float = 3e-3

    def answer(self, s: str) -> str:
        return s[::-1]


def make_splits(task: ReverseTask) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out records ``{"prompt": "abc=", "answer": "cba", "data_source": ...}``."""
    rng = random.Random(task.seed)
    seen: set[str] = set()
    out: list[dict] = []
    total = task.num_train + task.num_eval
    while len(out) < total:
        s = "".join(
            rng.choice(task.alphabet) for _ in range(rng.randint(task.min_len, task.max_len))
        )
        if s in seen or s == s[::-1]:  # palindromes cannot tell copying from reversing
            continue
        seen.add(s)
        out.append({"prompt": s + "=", "answer": task.answer(s), "data_source": f"reverse{len(s)}"})
    return out[: task.num_train], out[task.num_train :]


def build_tokenizer(task: ReverseTask, directory: Path) -> TextTokenizer:
    texts = [task.alphabet + "=", *(c * 3 for c in task.alphabet)]
    path = train_sentencepiece(
        texts, directory / "tokenizer", vocab_size=len(task.alphabet) + 6, model_type="char"
    )
    return load_tokenizer(path)


def model_config(task: ReverseTask, tokenizer: TextTokenizer) -> ModelConfig:
    return tiny_llama(
        tokenizer,
        hidden_size=task.hidden_size,
        num_layers=task.num_layers,
        max_positions=64,
        num_experts=task.num_experts,
    )


def teacher_targets(task: ReverseTask, records: list[dict], rng: np.random.Generator) -> list[str]:
    """The noisy teacher: the right answer with probability ``reverse_prob``, else a copy."""
    flips = rng.random(len(records)) < task.reverse_prob
    return [r["answer"] if f else r["prompt"][:-1] for r, f in zip(records, flips)]


def train_base_model(
    task: ReverseTask, tokenizer: TextTokenizer, train: list[dict], *, key: jax.Array, log=print
) -> Transformer:
    """The short supervised phase: imitate the noisy teacher on the training prompts."""
    return supervised_phase(
        model_config(task, tokenizer),
        tokenizer,
        train,
        lambda records, rng: teacher_targets(task, records, rng),
        steps=task.sft_steps,
        batch=task.sft_batch,
        learning_rate=task.sft_learning_rate,
        seed=task.seed,
        key=key,
        log=log,
    )


# ----------------------------------------------------------------------------- offline datasets
# The same task as data for the offline trainers: the right behaviour (reverse) against the base
# model's preferred wrong one (copy). Rows use TRL's column names.


def copy_of(record: dict) -> str:
    """The wrong answer the base model prefers: the string copied."""
    return record["prompt"][:-1]


def sft_records(records: list[dict]) -> list[dict]:
    """``{"prompt", "completion", "answer"}``: the right answer as the completion."""
    return [
        {"prompt": r["prompt"], "completion": r["answer"], "answer": r["answer"]} for r in records
    ]


def preference_records(records: list[dict]) -> list[dict]:
    """``{"prompt", "chosen", "rejected", "answer"}``: reverse preferred to copy."""
    return [
        {
            "prompt": r["prompt"],
            "chosen": r["answer"],
            "rejected": copy_of(r),
            "answer": r["answer"],
        }
        for r in records
    ]


def unpaired_records(records: list[dict], seed: int) -> list[dict]:
    """``{"prompt", "completion", "label", "answer"}`` (KTO): each prompt with either its right
    answer (label true) or the copy (label false), at random."""
    rng = np.random.default_rng(seed)
    good = rng.random(len(records)) < 0.5
    return [
        {
            "prompt": r["prompt"],
            "completion": r["answer"] if g else copy_of(r),
            "label": bool(g),
            "answer": r["answer"],
        }
        for r, g in zip(records, good)
    ]


def write_task_data(task: ReverseTask, directory: Path, rows_of) -> tuple[str, str]:
    """``rows_of(records)`` for the train and held-out splits, written as jsonl: their paths."""
    train, held_out = make_splits(task)
    return (
        str(write_jsonl(rows_of(train), directory / "train.jsonl")),
        str(write_jsonl(rows_of(held_out), directory / "eval.jsonl")),
    )
