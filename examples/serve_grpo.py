"""GRPO written as client code against the training service (a Tinker-cookbook-style RL loop).

    python -m relax.serve &                      # the built-in reverse task's base model, 127.0.0.1:8470
    python examples/serve_grpo.py                # this loop: sample, score, advantages, one step
    python examples/serve_grpo.py --url http://tpu-vm:8470 --rank 16 --steps 100

The server holds the model; this process only samples through a ``SamplingClient``, scores the
completions (exact match of the reversed string), builds ``Datum`` s with the sampler's
log-probs and the group-centred advantages, and calls ``forward_backward(datums,
"importance_sampling")`` then ``optim_step``. The task's prompts and answers are made here
(``relax.tasks.reverse``: the same seed, the same split as the server's built-in task); the
tokenizer comes from the server (``get_tokenizer``). Every ``eval_every`` steps it reports the
held-out exact match of greedy completions. ``main`` returns the history.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import tyro

import relax.serve as tinker  # a Tinker loop's `import tinker`, changed
from relax.serve import types
from relax.tasks.reverse import ReverseTask, make_splits


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    url: str = "http://127.0.0.1:8470"
    rank: int = 8
    seed: int = 0
    steps: int = 40
    batch_size: int = 16  # prompts per step
    group_size: int = 8  # completions per prompt
    max_tokens: int = 8
    learning_rate: float = 3e-3
    eval_every: int = 10  # 0: never
    eval_prompts: int = 64


def datums(prompt: list[int], sequences, advantages) -> list[types.Datum]:
    """One datum per completion: the model reads prompt + completion[:-1] and predicts the next token;
    the prompt's positions carry advantage 0 (no loss)."""
    out = []
    for seq, a in zip(sequences, advantages):
        tokens, n = prompt + seq.tokens, len(prompt) - 1
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(tokens[1:], np.int32),
                    "logprobs": np.asarray([0.0] * n + seq.logprobs, np.float32),
                    "advantages": np.asarray([0.0] * n + [a] * len(seq.tokens), np.float32),
                },
            )
        )
    return out


def exact_match(tokenizer, sequences, answer: str) -> np.ndarray:
    texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in sequences]
    return np.asarray([float(t.strip() == answer) for t in texts])


def held_out(sampler, tokenizer, rows: list[dict]) -> float:
    prompts = [types.ModelInput.from_ints(tokenizer.encode(r["prompt"])) for r in rows]
    responses = sampler.sample_many(
        prompts, 1, types.SamplingParams(max_tokens=8, temperature=0.0)
    ).result()
    return float(
        np.mean(
            [
                exact_match(tokenizer, r.sequences, row["answer"])[0]
                for r, row in zip(responses, rows)
            ]
        )
    )


def main(cfg: LoopConfig, service: tinker.ServiceClient | None = None) -> list[dict]:
    """The loop against ``cfg.url`` (or ``service``: e.g. a ``LocalServiceClient``); the history."""
    service = tinker.ServiceClient(cfg.url) if service is None else service
    trainer = service.create_lora_training_client(rank=cfg.rank, seed=cfg.seed)
    tokenizer = trainer.get_tokenizer()
    train, evaluation = make_splits(ReverseTask())
    rng = np.random.default_rng(cfg.seed)
    history = []
    for step in range(cfg.steps + 1):
        start = time.perf_counter()
        sampler = trainer.save_weights_and_get_sampling_client(f"step{step}")
        record: dict = {"step": step}
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            record["held_out_exact_match"] = held_out(
                sampler, tokenizer, evaluation[: cfg.eval_prompts]
            )
        if step == cfg.steps:
            history.append(record)
            print(json.dumps(record), flush=True)
            break
        rows = [train[i] for i in rng.choice(len(train), cfg.batch_size, replace=False)]
        prompts = [tokenizer.encode(r["prompt"]) for r in rows]
        responses = sampler.sample_many(
            [types.ModelInput.from_ints(p) for p in prompts],
            cfg.group_size,
            types.SamplingParams(max_tokens=cfg.max_tokens),
        ).result()
        data, rewards = [], []
        for prompt, response, row in zip(prompts, responses, rows):
            r = exact_match(tokenizer, response.sequences, row["answer"])
            rewards.append(r.mean())
            data += datums(prompt, response.sequences, r - r.mean())
        fb = trainer.forward_backward(data, loss_fn="importance_sampling")
        update = trainer.optim_step(types.AdamParams(learning_rate=cfg.learning_rate))
        record.update(
            reward=float(np.mean(rewards)),
            loss=fb.result().metrics["loss"],
            grad_norm=update.result().metrics["grad_norm"],
            seconds=time.perf_counter() - start,
        )
        history.append(record)
        print(json.dumps(record), flush=True)
    trainer.close()
    return history


if __name__ == "__main__":
    main(tyro.cli(LoopConfig, description=__doc__))
