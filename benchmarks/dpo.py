"""The DPO step with the prompt shared by chosen and rejected vs two separate forwards.

One DPO step (``relax.algorithms.dpo.make_dpo_step``: the reference model's forward, then one
optimizer step) on P pairs of random tokens, timed three ways that compute the same loss:

- ``shared``: relax's layout, ``tokens [P, 2, N]`` through the prefix-shared forward: each prompt
  runs once, its two completions attend to its keys/values (``completion_logprobs``);
- ``separate_prefix``: the same kernels without the sharing: ``[prompt; chosen]`` and
  ``[prompt; rejected]`` as 2P prompt groups of one completion each (the prompt runs twice);
- ``separate_full``: two plain full-sequence forwards (``hidden_states`` over 2P rows of
  ``[prompt; completion]``, the log-probs of the completion positions only), as TRL's concatenated
  forward does.

``--reference cached`` leaves the reference forward out (``precompute_reference``: the update
alone). Default shape: the small config (``relax.models.small_config()``: vocab 4096, hidden 256,
4 layers), float32, 8 pairs, 256-token prompts, 64-token completions, sigmoid loss, relax's default
micro-batching (one pair per micro-batch on one CPU device).

    python benchmarks/dpo.py --runs 3
    python benchmarks/dpo.py --pairs 8 --prompt-len 256 --completion-len 64 --reference cached

The cases are compiled first, then timed in interleaved rounds (one step of each case per
round), so that other load on the machine falls on every case alike. Prints one JSON line per
case: median seconds per step, pairs/s, compile seconds, the loss (equal
across the cases up to rounding) and the step's achieved FLOP/s against the matmul peak measured here.
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
from harness import emit, peak_flops  # noqa: E402

from relax.algorithms.dpo import DPOConfig, make_dpo_step  # noqa: E402
from relax.algorithms.preference.pairs import PairRows, shared_forward  # noqa: E402
from relax.data.pairs import PairBatch  # noqa: E402
from relax.models import hidden_states, init, small_config  # noqa: E402
from relax.models.decoder.logprobs import logprobs_from_hidden  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.run import CompileCounter  # noqa: E402
from relax.train.state import init_state  # noqa: E402

FORWARDS = ("shared", "separate_prefix", "separate_full")


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 5
    pairs: int = 8
    prompt_len: int = 256
    completion_len: int = 64
    loss_type: str = "sigmoid"
    reference: str = "model"
    """model: the step runs the reference forward | cached: precomputed, the update alone | both"""
    forward: str = "all"
    """shared | separate_prefix | separate_full | all"""
    grad_accum: int | None = None


def separate_prefix(passes, cfg):
    """The prefix-shared kernels with each completion its own prompt group: 2P groups of one."""
    base = shared_forward(passes, cfg.forward)

    def forward(model, mb, train):
        p, g, n = mb.tokens.shape
        rows = PairRows(
            prompt_ids=jnp.repeat(mb.prompt_ids, g, 0),
            prompt_mask=jnp.repeat(mb.prompt_mask, g, 0),
            tokens=mb.tokens.reshape(p * g, 1, n),
            mask=mb.mask.reshape(p * g, 1, n),
            loss_mask=jnp.ones((p * g,), jnp.int32),
        )  # read by no forward; rope: computed by it
        return base(model, rows, train).reshape(p, g, n)

    return forward


def separate_full(model, mb, train):
    """Two full-sequence forwards as 2P rows; log-probs of the completion positions only."""
    p, g, n = mb.tokens.shape
    lp = mb.prompt_ids.shape[1]
    ids = jnp.concatenate([jnp.repeat(mb.prompt_ids, g, 0), mb.tokens.reshape(p * g, n)], 1)
    mask = jnp.concatenate([jnp.repeat(mb.prompt_mask, g, 0), mb.mask.reshape(p * g, n)], 1)
    h = hidden_states(model, ids, mask)
    return logprobs_from_hidden(model, h[:, lp - 1 : -1], ids[:, lp:]).reshape(p, g, n)


class Case:
    """One (forward, reference) configuration: its step, state and batch, compiled by the first call."""

    def __init__(self, args: Args, forward_name: str, reference: str):
        self.forward_name, self.reference = forward_name, reference
        self.mcfg = mcfg = small_config()
        passes = choose_passes()
        cfg = DPOConfig(
            loss_type=args.loss_type,
            max_prompt_tokens=args.prompt_len,
            max_completion_tokens=args.completion_len,
            grad_accum=args.grad_accum,
            precompute_reference=reference == "cached",
            optimizer=OptimizerConfig(learning_rate=1e-6),
        )
        forward = {
            "shared": None,
            "separate_prefix": separate_prefix(passes, cfg),
            "separate_full": separate_full,
        }[forward_name]
        model = init(mcfg, jax.random.key(0))
        ref = jax.tree.map(
            lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x, model
        )
        self.state = init_state(model, cfg.optimizer.make(), key=jax.random.key(1)).replace(
            ref=ref if cfg.needs_reference else None
        )
        self.step = make_dpo_step(cfg, passes, forward=forward)
        p, lp, n = args.pairs, args.prompt_len, args.completion_len
        k = jax.random.split(jax.random.key(2), 2)
        ref_logps = (
            jnp.stack([jnp.full((p,), -300.0), jnp.full((p,), -301.0)], -1)
            if reference == "cached"
            else None
        )
        self.batch = PairBatch(
            prompt_ids=jax.random.randint(k[0], (p, lp), 0, mcfg.vocab_size),
            prompt_mask=jnp.ones((p, lp), jnp.int32),
            tokens=jax.random.randint(k[1], (p, 2, n), 0, mcfg.vocab_size),
            mask=jnp.ones((p, 2, n), jnp.int32),
            loss_mask=jnp.ones((p,), jnp.int32),
            ref_logps=ref_logps,
        )
        self.times: list[float] = []
        self.first = self.once()  # compiles

    def once(self) -> float:
        t0 = time.perf_counter()
        self.state, self.out = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, self.out.metrics))
        return time.perf_counter() - t0

    def record(self, args: Args, recompiles: int) -> dict:
        mcfg, times = self.mcfg, self.times
        med = statistics.median(times)
        p, lp, n = args.pairs, args.prompt_len, args.completion_len
        # FLOPs: forward + backward 6 * params * tokens of the update, 2 * params * tokens of the
        # reference forward; embedding lookups free, the head counted (num_params counts it once)
        n_params = mcfg.num_params() - mcfg.vocab_size * mcfg.hidden_size
        tokens = p * (lp + 2 * n) if self.forward_name == "shared" else 2 * p * (lp + n)
        flops = (6 + (2 if self.reference == "model" else 0)) * n_params * tokens
        peak, peak_source = peak_flops()
        return emit(
            {
                "bench": "dpo_step",
                "forward": self.forward_name,
                "reference": self.reference,
                "loss_type": args.loss_type,
                "params": mcfg.num_params(),
                "P": p,
                "Lp": lp,
                "N": n,
                "grad_accum": args.grad_accum,
                "runs": len(times),
                "step_s": med,
                "min_step_s": min(times),
                "max_step_s": max(times),
                "spread": (max(times) - min(times)) / med,
                "pairs_per_s": p / med,
                "compile_s": round(self.first - med, 3),
                "compiles_after_first": recompiles,
                "loss": float(self.out.metrics["loss"]),
                "tokens_processed": tokens,
                "gflops": flops / med / 1e9,
                "peak_gflops": peak / 1e9,
                "peak_source": peak_source,
                "frac_of_peak": flops / med / peak,
            },
            table=[
                "forward",
                "reference",
                "step_s",
                "spread",
                "pairs_per_s",
                "compile_s",
                "loss",
                "frac_of_peak",
            ],
        )


def main(args: Args) -> list[dict]:
    forwards = FORWARDS if args.forward == "all" else (args.forward,)
    references = ("model", "cached") if args.reference == "both" else (args.reference,)
    for name in forwards + references:
        if name not in FORWARDS + ("model", "cached"):
            raise SystemExit(f"unknown --forward/--reference {name!r}")
    cases = [Case(args, f, r) for r in references for f in forwards]
    with CompileCounter() as recompiles:
        for _ in range(
            args.runs
        ):  # interleaved rounds: a load change on the machine hits every case alike
            for c in cases:
                c.times.append(c.once())
    return [c.record(args, recompiles.count) for c in cases]


if __name__ == "__main__":
    main(tyro.cli(Args))
