"""What every built-in task shares: a tiny Llama, its sentencepiece tokenizer trained on the task's
text, and a short supervised phase that imitates a (noisy) teacher to make the base model."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

from relax.data.supervised import pad_examples
from relax.masked import masked_mean
from relax.models.config.model import ModelConfig, family_config
from relax.models.decoder.logprobs import token_logprobs
from relax.models.decoder.transformer import Transformer, init
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.text import TextTokenizer, load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece
from relax.train.logs import is_main_process
from relax.train.primitives import forward_backward, optim_step
from relax.train.state import init_state

Teacher = Callable[[list[dict], np.random.Generator], list[str]]  # records -> target completions


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare(module, task, run_dir: Path, *, seed: int, teacher: str, log=print):
    """A built-in task in ``run_dir``: ``(tokenizer, base model, train rows, held-out rows)``. The
    rows are written to ``task/train.jsonl`` and ``task/eval.jsonl``; the base model is
    ``base_model`` (an HF directory with its tokenizer) when present, else ``module``'s supervised
    phase on its teacher (``teacher``: what the log says of it), saved there by the main process.
    ``module`` is the task's module (``make_splits``, ``build_tokenizer``, ``train_base_model``)."""
    task_dir, base_dir = run_dir / "task", run_dir / "base_model"
    train, held_out = module.make_splits(task)
    write_jsonl(train, task_dir / "train.jsonl")
    write_jsonl(held_out, task_dir / "eval.jsonl")
    tokenizer = module.build_tokenizer(task, task_dir)
    if (base_dir / "config.json").exists():
        log(f"base model: {base_dir} (reused)")
        model = load_pretrained(base_dir)
        if model.config.num_experts != getattr(task, "num_experts", 0):
            raise ValueError(
                f"{base_dir} holds a base model with {model.config.num_experts} experts, the task asks "
                f"for {getattr(task, 'num_experts', 0)}: use another --run-dir"
            )
        return tokenizer, model, train, held_out
    log(f"base model: a supervised phase on {teacher} ...")
    model = module.train_base_model(task, tokenizer, train, key=jax.random.key(seed), log=log)
    if is_main_process():
        save_pretrained(model, base_dir)
        tokenizer.save_pretrained(base_dir)  # a complete HF directory: transformers loads it
    return tokenizer, model, train, held_out


def task_tokenizer(
    texts: list[str], directory: Path, *, vocab_size: int, model_type: str = "bpe"
) -> TextTokenizer:
    """A sentencepiece tokenizer trained on the task's own text (nothing is downloaded)."""
    return load_tokenizer(
        train_sentencepiece(
            texts, directory / "tokenizer", vocab_size=vocab_size, model_type=model_type
        )
    )


def tiny_llama(
    tokenizer: TextTokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    max_positions: int,
    num_experts: int = 0,
) -> ModelConfig:
    """A tiny Llama (SwiGLU of width ``2 * hidden_size``); with ``num_experts`` E > 0 a tiny Mixtral
    instead: the same attention, and every MLP a mixture of E experts of width ``hidden_size``, two
    per token (the dense model's active MLP width)."""
    sizes = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if not num_experts:
        return ModelConfig(**sizes)
    return family_config(
        "mixtral",
        **{**sizes, "intermediate_size": hidden_size},
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden_size,
        norm_topk_prob=True,
    )


def supervised_phase(
    config: ModelConfig,
    tokenizer: TextTokenizer,
    train: list[dict],
    teacher: Teacher,
    *,
    steps: int,
    batch: int,
    learning_rate: float,
    seed: int,
    key: jax.Array,
    log=print,
) -> Transformer:
    """A fresh model trained for ``steps`` on ``teacher``'s completions of random training prompts
    (the token-mean NLL of the completion, ``nll``); the teacher is asked anew every step."""
    prompts = [
        tokenizer.encode(r["prompt"], add_special_tokens=True) for r in train
    ]  # BOS, as the data adds

    def sample(rng: np.random.Generator):
        idx = rng.choice(len(train), batch, replace=False)
        targets = teacher([train[j] for j in idx], rng)
        responses = [
            tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
            for t in targets
        ]
        length = max(len(prompts[j]) + len(r) for j, r in zip(idx, responses))
        return pad_examples(
            [prompts[j] for j in idx],
            responses,
            length=-(-length // 16) * 16,
            pad_id=tokenizer.pad_token_id,
        )

    return supervised_loop(
        config, sample, steps=steps, learning_rate=learning_rate, seed=seed, key=key, log=log
    )


def supervised_loop(
    config: ModelConfig,
    sample: Callable[[np.random.Generator], tuple],
    *,
    steps: int,
    learning_rate: float,
    seed: int,
    key: jax.Array,
    log=print,
) -> Transformer:
    """A fresh model (``init(config, key)``) trained for ``steps`` AdamW steps (warm-up, cosine decay)
    on ``nll`` of ``sample(rng) -> (ids, mask, loss_mask)``, a new batch every step."""
    rng = np.random.default_rng(seed)
    model = init(config, key, std=0.05)
    warmup = min(20, steps // 2)  # 20 unless the phase is shorter than 40 steps
    optimizer = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps), weight_decay=0.0
    )
    state = init_state(model, optimizer, key=key)
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = _supervised_step(state, sample(rng))
        if (i + 1) % 100 == 0:
            log(
                f"  supervised step {i + 1}/{steps}: loss {float(metrics['loss']):.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
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
