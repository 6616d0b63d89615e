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
import json
import random
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

from relax.data.supervised import pad_examples
from relax.masked import masked_mean
from relax.models.config import ModelConfig
from relax.models.logprobs import token_logprobs
from relax.models.transformer import Transformer, init
from relax.text import TextTokenizer, load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece
from relax.train.primitives import forward_backward, optim_step
from relax.train.state import init_state


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
        s = "".join(rng.choice(task.alphabet) for _ in range(rng.randint(task.min_len, task.max_len)))
        if s in seen or s == s[::-1]:  # palindromes cannot tell copying from reversing
            continue
        seen.add(s)
        out.append({"prompt": s + "=", "answer": task.answer(s), "data_source": f"reverse{len(s)}"})
    return out[:task.num_train], out[task.num_train:]


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_tokenizer(task: ReverseTask, directory: Path) -> TextTokenizer:
    texts = [task.alphabet + "=", *(c * 3 for c in task.alphabet)]
    path = train_sentencepiece(texts, directory / "tokenizer", vocab_size=len(task.alphabet) + 6, model_type="char")
    return load_tokenizer(path)


def model_config(task: ReverseTask, tokenizer: TextTokenizer) -> ModelConfig:
    return ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=task.hidden_size,
                       intermediate_size=2 * task.hidden_size, num_layers=task.num_layers, num_heads=4,
                       num_kv_heads=2, head_dim=task.hidden_size // 4, max_position_embeddings=64,
                       rope_theta=10000.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


def teacher_targets(task: ReverseTask, records: list[dict], rng: np.random.Generator) -> list[str]:
    """The noisy teacher: the right answer with probability ``reverse_prob``, else a copy."""
    flips = rng.random(len(records)) < task.reverse_prob
    return [r["answer"] if f else r["prompt"][:-1] for r, f in zip(records, flips)]


def train_base_model(task: ReverseTask, tokenizer: TextTokenizer, train: list[dict], *, key: jax.Array,
                     log=print) -> Transformer:
    """The short supervised phase: imitate the noisy teacher on the training prompts."""
    rng = np.random.default_rng(task.seed)
    model = init(model_config(task, tokenizer), key, std=0.05)
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=True) for r in train]  # BOS, as the data adds
    length = max(len(p) for p in prompts) + task.max_len + 3
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, task.sft_learning_rate, 20, task.sft_steps),
                            weight_decay=0.0)
    state = init_state(model, optimizer, key=key)
    t0 = time.perf_counter()
    for i in range(task.sft_steps):
        idx = rng.choice(len(train), task.sft_batch, replace=False)
        targets = teacher_targets(task, [train[j] for j in idx], rng)
        responses = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in targets]
        ids, mask, loss_mask = pad_examples([prompts[j] for j in idx], responses, length=length,
                                            pad_id=tokenizer.pad_token_id)
        state, metrics = _supervised_step(state, (ids, mask, loss_mask))
        if (i + 1) % 100 == 0:
            log(f"  supervised step {i + 1}/{task.sft_steps}: loss {float(metrics['loss']):.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
    return state.policy


def nll(model: Transformer, rows) -> tuple[jax.Array, dict]:
    """Token-mean negative log-likelihood of the response tokens::

        loss = - sum_t m_t log p(x_{t+1} | x_{<=t}) / sum_t m_t      (m: the loss mask, shifted)
    """
    ids, mask, loss_mask = rows
    return -masked_mean(token_logprobs(model, ids, mask), loss_mask[:, 1:]), {}


@eqx.filter_jit(donate="all")
def _supervised_step(state, rows):
    grads, metrics = forward_backward(state, rows, nll)
    return optim_step(state, grads), metrics


# ----------------------------------------------------------------------------- offline datasets
# The same task as data for the offline trainers: the right behaviour (reverse) against the base
# model's preferred wrong one (copy). Rows use TRL's column names.

def copy_of(record: dict) -> str:
    """The wrong answer the base model prefers: the string copied."""
    return record["prompt"][:-1]


def sft_rows(records: list[dict]) -> list[dict]:
    """``{"prompt", "completion", "answer"}``: the right answer as the completion."""
    return [{"prompt": r["prompt"], "completion": r["answer"], "answer": r["answer"]} for r in records]


def preference_rows(records: list[dict]) -> list[dict]:
    """``{"prompt", "chosen", "rejected", "answer"}``: reverse preferred to copy."""
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": copy_of(r), "answer": r["answer"]}
            for r in records]


def unpaired_rows(records: list[dict], seed: int) -> list[dict]:
    """``{"prompt", "completion", "label", "answer"}`` (KTO): each prompt with either its right
    answer (label true) or the copy (label false), at random."""
    rng = np.random.default_rng(seed)
    good = rng.random(len(records)) < 0.5
    return [{"prompt": r["prompt"], "completion": r["answer"] if g else copy_of(r), "label": bool(g),
             "answer": r["answer"]} for r, g in zip(records, good)]


def write_task_data(task: ReverseTask, directory: Path, rows_of) -> tuple[str, str]:
    """``rows_of(records)`` for the train and held-out splits, written as jsonl: their paths."""
    train, held_out = make_splits(task)
    return (str(write_jsonl(rows_of(train), directory / "train.jsonl")),
            str(write_jsonl(rows_of(held_out), directory / "eval.jsonl")))
