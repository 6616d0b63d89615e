"""Multi-turn rollouts: the KV cache carried across turns against re-prefilling the conversation.

The small model shape (``small_config``, random weights, no stop token) samples
``--turns`` turns of ``--turn-tokens`` tokens for P x G trajectories; after each turn but the
last, an observation of ``--obs-tokens`` tokens is added. Two ways, same shapes and token counts:

- ``carry`` (``relax.rollout.turns``, what ``relax.environments.rollout`` does): prefill each
  prompt once, then per turn ``decode_turn``, and ``append`` the observation onto the cache;
- ``reprefill`` (what a sampler without a carried cache does): per turn, prefill the whole
  conversation so far (prompt, earlier turns, observations) of every trajectory as a new prompt
  (``start``, G = 1), then ``decode_turn``.

Reports medians of ``--runs`` rollouts after one warm-up (compiles), and the tokens each way
prefilled.

    python benchmarks/multi_turn.py
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402

from relax.models import init, small_config  # noqa: E402
from relax.rollout import turns as T  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 3
    prompts: int = 8
    generations: int = 4
    prompt_tokens: int = 128
    turns: int = 4
    turn_tokens: int = 32
    obs_tokens: int = 64


def carry(model, prompt, cfg: T.TurnConfig, a: Args):
    b = a.prompts * a.generations
    obs = jnp.full((b, a.obs_tokens), 7, jnp.int32)
    state = T.start(model, prompt, jnp.ones_like(prompt), jax.random.key(1), cfg=cfg)
    for turn in range(a.turns):
        state, _, _ = T.decode_turn(model, state, jnp.ones(b, bool), cfg=cfg)
        if turn + 1 < a.turns:
            state = T.append(model, state, obs, jnp.full(b, a.obs_tokens, jnp.int32), cfg=cfg)
    return jax.block_until_ready(state.tokens)


def reprefill(model, prompt, cfg: T.TurnConfig, a: Args):
    b = a.prompts * a.generations
    conv = jnp.repeat(prompt, a.generations, axis=0)
    one = dataclasses.replace(cfg, num_generations=1)
    obs = jnp.full((b, a.obs_tokens), 7, jnp.int32)
    for turn in range(a.turns):
        state = T.start(
            model, conv, jnp.ones_like(conv), jax.random.fold_in(jax.random.key(1), turn), cfg=one
        )
        state, _, _ = T.decode_turn(model, state, jnp.ones(b, bool), cfg=one)
        parts = [conv, state.tokens[:, : a.turn_tokens]] + ([obs] if turn + 1 < a.turns else [])
        conv = jnp.concatenate(parts, axis=1)
    return jax.block_until_ready(conv)


def timed(fn, runs: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(a: Args):
    model = init(small_config(), jax.random.key(0), std=0.02)
    stop = model.config.vocab_size  # no token: every turn runs to its budget
    slots = a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    cfg = T.TurnConfig(
        num_generations=a.generations,
        max_tokens=slots,
        max_turn_tokens=a.turn_tokens,
        eos_ids=(stop,),
        sampling=SamplingConfig(temperature=1.0),
    )
    prompt = jax.random.randint(
        jax.random.key(0), (a.prompts, a.prompt_tokens), 1, model.config.vocab_size
    )
    b = a.prompts * a.generations
    carried = timed(lambda: carry(model, prompt, cfg, a), a.runs)
    redone = timed(lambda: reprefill(model, prompt, cfg, a), a.runs)
    per_turn = a.turn_tokens + a.obs_tokens
    prefilled_redo = sum(b * (a.prompt_tokens + k * per_turn) for k in range(a.turns))
    prefilled_carry = a.prompts * a.prompt_tokens + b * (a.turns - 1) * a.obs_tokens
    emit(
        {
            "bench": "multi_turn",
            **dataclasses.asdict(a),
            "carry_s": carried,
            "reprefill_s": redone,
            "saving": 1.0 - carried / redone,
            "prefilled_tokens_carry": prefilled_carry,
            "prefilled_tokens_reprefill": prefilled_redo,
            "sampled_tokens_per_s_carry": b * a.turns * a.turn_tokens / carried,
        }
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
