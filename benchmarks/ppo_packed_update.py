"""PPO's advantage and update padded vs packed (``relax.models.forward.completion_packing``) on
completion lengths with a long tail, against the padding-free ideal: the GRPO benchmark's batch
(``packed_update.py``: log-normal lengths, random tokens, 64-token prompts) through PPO's own
program, the ``advantage`` stage (the critic's values of the sampled states, GAE) and the
``update`` stage (the actor's and the critic's updates) composed, as a run compiles them.

    advantage_update_padded      the two stages on the [P, G, N] padded batch
    advantage_update_packed      the same batch packed across groups into bins (on the host,
                                 untimed): the values and both updates over the bins
    advantage_update_no_padding  the padded program on [P, G, L], L = round(mean length), masks
                                 all ones: the same real tokens with no padding

The critic is PPO's default (``--ppo.critic``: a separate copy of the policy), so each variant runs
three forwards and two backwards. Medians over ``--runs`` after one warm-up call each, the
variants alternating per run.

    python benchmarks/ppo_packed_update.py [--runs 3] [--model-shape small]
    python benchmarks/ppo_packed_update.py --new-tokens 256 --prompts 2 --runs 1   # quick

Prints one JSON line: length statistics, real / padded / packed slots, the bins used and their
fill, each variant's median seconds, packed_over_no_padding and packed_speedup.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import alternate, emit  # noqa: E402
from packed_update import Args, batch_fields, lengths, model_of  # noqa: E402

from relax.algorithms.cli.configure import configure  # noqa: E402
from relax.algorithms.online.batch import Scored  # noqa: E402
from relax.algorithms.ppo.config import PPOConfig  # noqa: E402
from relax.algorithms.ppo.run import make_state  # noqa: E402
from relax.algorithms.ppo.step import make_advantage, make_update_stage  # noqa: E402
from relax.compose import compose  # noqa: E402
from relax.data.completion_layout import PackingConfig, pack_bins  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402


def scored(args: Args, vocab: int, lens: np.ndarray, n: int) -> Scored:
    """A scored batch of completions of ``lens`` (prefix masks), random tokens and rewards."""
    p, g = lens.shape
    rng = np.random.default_rng(args.seed + 1)
    mask = (np.arange(n)[None, None, :] < lens[..., None]).astype(np.int32)
    ids = rng.integers(0, vocab, (p, args.prompt_len), dtype=np.int32)
    logp = lambda: (-2.0 + 0.1 * rng.standard_normal((p, g, n))).astype(np.float32)  # noqa: E731
    fields = dict(
        prompt_ids=ids,
        prompt_mask=np.ones_like(ids),
        tokens=rng.integers(0, vocab, (p, g, n), dtype=np.int32),
        mask=mask,
        old_logprobs=logp(),
        ref_logprobs=logp(),
        lengths=lens.astype(np.int32),
        finished=lens < n,
        policy_version=np.zeros((p, g), np.int32),
        rewards=rng.standard_normal((p, g)).astype(np.float32),
    )
    rewards = jnp.asarray(fields["rewards"])
    return Scored(
        **{k: jnp.asarray(v) for k, v in fields.items()}, reward_parts={"reward": rewards}
    )


def build(args: Args):
    """``(variants, setup)``: each variant's call and what ``main`` reports of the setup."""
    mcfg, model = model_of(args)
    dtype = jnp.dtype(args.dtype)
    p, g, n = args.prompts, args.generations, args.new_tokens
    passes = choose_passes()
    packing = PackingConfig(bin_tokens=args.bin_tokens)

    def step(budget):
        cfg = configure(
            PPOConfig,
            num_generations=g,
            max_new_tokens=budget,
            packing=packing,
            remat=False,  # as packed_update.py's figures ran
            optimizer=OptimizerConfig(learning_rate=1e-6),
        )
        return cfg, compose(make_advantage(cfg), make_update_stage(cfg, passes), name="ppo")

    lens = lengths(args)
    flat_len = max(1, int(round(float(lens.mean()))))
    cfg, padded_step = step(n)
    _, flat_step = step(flat_len)
    state = make_state(cfg, model, jax.random.key(0), dtype=dtype, param_dtype=dtype)

    padded = scored(args, mcfg.vocab_size, lens, n)
    host = [
        np.asarray(x) for x in (padded.prompt_ids, padded.prompt_mask, padded.tokens, padded.mask)
    ]
    sizes = packing.sizes(p, g, args.prompt_len, n, block=passes.stream_block)
    pk = pack_bins(*host, sizes)
    packed = padded.replace(packed=jax.tree.map(jnp.asarray, pk))
    flat = scored(args, mcfg.vocab_size, np.full((p, g), flat_len), flat_len)

    held = [state]  # the update donates the state it is given: each call takes the last one's

    def run(s, batch):
        def call():
            held[0], out = s(held[0], batch)
            return out.metrics["loss"]

        return call

    variants = {
        "advantage_update_padded": run(padded_step, padded),
        "advantage_update_packed": run(padded_step, packed),
        "advantage_update_no_padding": run(flat_step, flat),
    }
    return variants, dict(mcfg=mcfg, lens=lens, sizes=sizes, pk=pk, flat_len=flat_len, cfg=cfg)


def main(args: Args) -> dict:
    variants, setup = build(args)
    lens, sizes, pk = setup["lens"], setup["sizes"], setup["pk"]
    med, first = alternate(variants, args.runs)
    return emit(
        {
            "bench": "ppo_packed_update",
            "model_shape": args.model_shape,
            "dtype": args.dtype,
            "critic": setup["cfg"].critic,
            "params": setup["mcfg"].num_params(),
            **batch_fields(args, lens, sizes, pk, setup["flat_len"]),
            **med,
            "first_call_s": {k: round(v, 3) for k, v in first.items()},
            "packed_over_no_padding": med["advantage_update_packed"]
            / med["advantage_update_no_padding"],
            "packed_speedup": med["advantage_update_padded"] / med["advantage_update_packed"],
        },
        table=[
            "bench",
            "N",
            "mean_len",
            "pack_bins",
            "pack_fill",
            "advantage_update_padded",
            "advantage_update_packed",
            "advantage_update_no_padding",
            "packed_speedup",
            "packed_over_no_padding",
        ],
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
