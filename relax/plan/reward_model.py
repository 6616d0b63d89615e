"""An online run's reward model (``--reward-model DIR``) in its plan: its weights on every chip of
the trainer, and the program that scores completions with them.

The run loads the reward model once (``load_reward_model``: float32 compute, parameters as
stored), lays it out on the trainer mesh by the sharding rules, as the policy
(``relax.algorithms.online.rewards.reward_functions``), and keeps it there through the run: its
weights are resident beside every program on those chips. It scores the decoded completions
with its own tokenizer (``relax.rewards.model.TextRewardModel``): ``batch_size`` samples per call
of one compiled forward, the weights an argument of it, the host's token arrays replicated over
the mesh, prompts and completions padded to its length buckets. A plan lowers that forward
(``sequence_rewards``) with the weights as sharded ``ShapeDtypeStruct`` s (the directory's
``config.json`` is all it reads) and the longest buckets the run's lengths give, counted in the
policy's tokens (the reward model's tokenizer may count a text a little differently).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from relax.algorithms.online.config import OnlineAlgorithm, OnlineRunConfig
from relax.models.decoder.transformer import init as init_model
from relax.models.forward.forward_pass import ForwardPass
from relax.models.heads.reward_model import RewardModel, init_reward_model, sequence_rewards
from relax.parallel import replicated
from relax.passes import target_backend
from relax.plan.checkpoints import stored_dtype, value_model_config
from relax.plan.measure import Measured, is_sampler, measure, resident_state
from relax.plan.memory import per_chip, with_reward_model
from relax.plan.programs import Program, laid_out, platform
from relax.plan.targets import Target
from relax.rewards.model import BUCKETS, TextRewardModel
from relax.rollout.config import bucket_length

NAME = "reward_model"


def abstract_reward_model(run: OnlineRunConfig, mesh: jax.sharding.Mesh) -> RewardModel:
    """The run's reward model as ``ShapeDtypeStruct`` s laid out on the trainer ``mesh``."""
    config, dtype = value_model_config(run.reward_model), stored_dtype(run.reward_model)
    model = jax.eval_shape(
        lambda key: init_reward_model(
            init_model(config, key, param_dtype=dtype, dtype=jnp.float32), head_std=0.0
        ),
        jax.random.key(0),
    )
    return laid_out(model, mesh)


def weights_per_chip(model: RewardModel) -> int:
    """Bytes of the reward model on each chip of its mesh."""
    return per_chip(eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct)))


def score_arrays(
    run: OnlineRunConfig, scorer: TextRewardModel, completion_tokens: int, mesh
) -> tuple[Any, ...]:
    """The token arrays of one call of the scorer, replicated over ``mesh``: ``batch_size`` prompts
    of the bucket that holds ``--max-prompt-tokens`` and completions of the bucket that holds
    ``completion_tokens`` and an EOS, each capped by the scorer's own budgets."""
    rows = scorer.batch_size
    lp = bucket_length(min(run.max_prompt_tokens, scorer.max_prompt_tokens), BUCKETS)
    n = bucket_length(min(completion_tokens + 1, scorer.max_completion_tokens), BUCKETS)
    typed = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated(mesh))
    return typed(rows, lp), typed(rows, lp), typed(rows, 1, n), typed(rows, 1, n)


def reward_model_program(
    run: OnlineRunConfig,
    model: RewardModel,
    completion_tokens: int,
    resident: Any,
    compile_fn: Callable[[Any], tuple],
) -> Program:
    """The scorer's forward, compiled on the reward model's mesh. ``resident``: the train state
    as it lies on the trainer's chips meanwhile (the program's ``args`` are ``(resident, token
    arrays)``; the weights are counted apart, ``weights_per_chip``)."""
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    scorer = TextRewardModel(model, tokenizer=None)  # the run's scorer, with its defaults
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    how = ForwardPass(attention="auto")  # TextRewardModel's
    arrays = score_arrays(run, scorer, completion_tokens, mesh)
    scores = jax.jit(lambda p, *a: sequence_rewards(eqx.combine(p, static), *a, how))
    with target_backend(platform(mesh.devices.flat[0])), jax.set_mesh(mesh):
        compiled, error, seconds = compile_fn(scores.lower(params, *arrays))
    return Program(NAME, mesh, (resident, arrays), compiled, error, seconds)


def add_reward_model(
    run: OnlineRunConfig,
    algo: OnlineAlgorithm,
    measured: list[Measured],
    target: Target,
    compile_fn: Callable[[Any], tuple],
) -> list[Measured]:
    """``measured`` (an online run's programs) with the reward model's weights resident beside
    every program on the trainer's chips, and its scoring program after the sampler."""
    trainer = measured[-1].program.mesh  # the update's
    model = abstract_reward_model(run, trainer)
    weights = weights_per_chip(model)
    program = reward_model_program(
        run, model, algo.generation.max_new_tokens, resident_state(run, measured), compile_fn
    )
    beside = lambda m: dataclasses.replace(m, memory=with_reward_model(m.memory, weights))
    placed = [beside(m) if m.program.mesh == trainer else m for m in measured]
    after = next((i + 1 for i, m in enumerate(measured) if is_sampler(m.program.name)), 0)
    return [*placed[:after], beside(measure(program, target)), *placed[after:]]
