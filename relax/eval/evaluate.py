"""Held-out evaluation of a policy: greedy accuracy, mean reward, pass@1 and pass@k.

``correct`` means reward >= ``correct_threshold`` (1.0 for exact / numeric match). pass@k uses
the unbiased estimator over ``n`` samples per prompt (``relax.eval.passk.pass_at_k``), grouped
by data source when the data has one.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from relax.data.prompts import PromptBatch
from relax.eval.passk import summarize
from relax.rewards.functions import score_groups
from relax.rollout.sampler import RolloutConfig, compiled_generate
from relax.rollout.sampling import SamplingConfig
from relax.text.stop_strings import truncate_at_stop_strings


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """``num_samples`` completions per prompt at ``temperature`` for pass@k (``ks``; empty =
    1, 2, 4, ... n), plus one greedy completion; prompts go through the sampler
    ``batch_prompts`` at a time (the last chunk is padded, so one compile serves all)."""

    num_samples: int = 4
    temperature: float = 1.0
    ks: tuple[int, ...] = ()
    correct_threshold: float = 1.0
    batch_prompts: int = 64
    greedy: bool = True


def sampler_configs(
    cfg: EvalConfig, *, eos_ids: tuple[int, ...], pad_id: int, max_new_tokens: int
) -> dict[str, RolloutConfig]:
    """The samplers an evaluation runs: ``"greedy"`` (one completion at temperature 0, with
    ``cfg.greedy``) and ``"sampled"`` (``cfg.num_samples`` at ``cfg.temperature``)."""
    sampler = lambda n, t: RolloutConfig(  # noqa: E731
        num_generations=n,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=t),
        eos_ids=eos_ids,
        pad_id=pad_id,
    )
    greedy = {"greedy": sampler(1, 0.0)} if cfg.greedy else {}
    return {**greedy, "sampled": sampler(cfg.num_samples, cfg.temperature)}


def sampler_calls(
    batch: PromptBatch,
    cfg: EvalConfig,
    *,
    eos_ids: tuple[int, ...],
    pad_id: int,
    max_new_tokens: int,
) -> dict[str, tuple]:
    """Each sampler of ``sampler_configs`` as ``evaluate`` calls it: ``(jitted, prompt_ids,
    prompt_mask)``, the prompts of one call (``cfg.batch_prompts`` of ``batch``'s, the last call
    padded to as many): ``jitted(model, prompt_ids, prompt_mask, key)``, or
    ``jitted.lower(...)`` to compile it before the evaluation."""
    chunk = min(cfg.batch_prompts, batch.prompt_ids.shape[0])
    ids, mask = batch.prompt_ids[:chunk], batch.prompt_mask[:chunk]
    configs = sampler_configs(cfg, eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=max_new_tokens)
    return {name: (compiled_generate(rcfg), ids, mask) for name, rcfg in configs.items()}


def _generate_all(model, batch: PromptBatch, rcfg: RolloutConfig, key, chunk: int, images=None):
    """Tokens and masks ``[P, G, N]`` for all prompts, ``chunk`` prompts per sampler call
    (``images``: the prompts' ``PromptInputs``, sliced with them)."""
    p = batch.prompt_ids.shape[0]
    chunk = min(chunk, p)
    fn = compiled_generate(rcfg)
    toks, masks = [], []
    for start in range(0, p, chunk):
        idx = np.arange(start, start + chunk) % p  # pad the last chunk by wrapping around
        part = None if images is None else jax.tree.map(lambda x, idx=idx: x[idx], images)
        ids, mask = batch.prompt_ids[idx], batch.prompt_mask[idx]
        r = fn(model, ids, mask, jax.random.fold_in(key, start), prompt=part)
        n_real = min(chunk, p - start)
        toks.append(np.asarray(r.tokens)[:n_real])
        masks.append(np.asarray(r.mask)[:n_real])
    return np.concatenate(toks), np.concatenate(masks)


def evaluate(
    model,
    batch: PromptBatch,
    *,
    reward_fns,
    decode,
    eos_ids: tuple[int, ...],
    pad_id: int,
    max_new_tokens: int,
    key,
    cfg: EvalConfig,
    answer_field: str | None = "answer",
    timeout_s: float | None = None,
    stop_strings: tuple[str, ...] = (),
    images=None,
) -> dict[str, float]:
    """Metrics over every prompt of ``batch`` (keys like ``pass@1``, ``greedy/accuracy``);
    completions end at their first ``stop_strings`` match as in training. ``images``: image
    prompts' inputs (``relax.models.decoder.prompt_inputs.PromptInputs``, one row per prompt)."""
    fields = dict(batch.fields)
    if answer_field is not None:
        fields[answer_field] = list(batch.answers)
    out: dict[str, float] = {}

    def rewards_of(tokens, masks):
        masks, _, _ = truncate_at_stop_strings(
            tokens, masks, np.zeros(tokens.shape[:-1], bool), decode, stop_strings
        )
        return score_groups(
            reward_fns, decode, batch.prompts, fields, tokens, masks, timeout_s=timeout_s
        )[0]

    rcfgs = sampler_configs(cfg, eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=max_new_tokens)
    if "greedy" in rcfgs:
        r = rewards_of(
            *_generate_all(model, batch, rcfgs["greedy"], key, cfg.batch_prompts, images)
        )
        out["greedy/accuracy"] = float(np.mean(r >= cfg.correct_threshold))
        out["greedy/reward"] = float(np.nanmean(r))
    r = rewards_of(
        *_generate_all(
            model, batch, rcfgs["sampled"], jax.random.fold_in(key, 1), cfg.batch_prompts, images
        )
    )
    out.update(
        summarize(r, r >= cfg.correct_threshold, ks=cfg.ks or None, data_source=batch.data_source)
    )
    return out
