"""An online run's reward functions from its flags: the built-in rewards (``--reward``), a reward
model directory (``--reward-model``), a generative judge (``--judge.*``), the columns they read and
the worker pool that runs them."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh

from relax.algorithms.online.config import OnlineRunConfig
from relax.models.config.model import DTYPES
from relax.models.heads.reward_model import load_reward_model
from relax.models.hf.checkpoint import load_pretrained
from relax.parallel import make_mesh, state_shardings
from relax.parallel.distributed import multi_process, on_host_memory
from relax.rewards.builtin import get_reward, make_exact_match, make_numeric_match
from relax.rewards.code_exec import CodeExec
from relax.rewards.functions import RewardFunction
from relax.rewards.generative_judge import GenerativeJudge, device_judge, http_judge
from relax.rewards.math_answers import MathVerify
from relax.rewards.model import TextRewardModel
from relax.rewards.pool import PoolConfig, RewardPool
from relax.text import load_tokenizer


def reward_function(cfg: OnlineRunConfig, name: str):
    """The built-in reward ``name`` configured by the run's flags (answer / tests columns, sandbox)."""
    if name == "code_exec":
        return CodeExec(tests_field=cfg.tests_field, sandbox=cfg.sandbox)
    if name == "math_verify":
        return MathVerify(answer_field=cfg.answer_field)
    if name == "exact_match":
        return make_exact_match(cfg.answer_field)
    if name == "numeric_match":
        return make_numeric_match(cfg.answer_field)
    return get_reward(name)


def reward_columns(cfg: OnlineRunConfig) -> tuple[str, ...]:
    """The columns the built-in rewards read besides the prompt and the answer (which the data
    checks): ``code_exec``'s tests. Every row must have them, checked before any compute."""
    return (cfg.tests_field,) if "code_exec" in cfg.reward else ()


def reward_pool(cfg: OnlineRunConfig, reward_fns: list[RewardFunction]) -> RewardPool | None:
    """The worker pool of the run's host reward functions (``--reward-workers``; None for 0). A
    reward model scoring texts and a generative judge stay in the trainer process: they hold
    device arrays (or, over HTTP, their own threads), and the judge's metrics are read there."""
    pooled = [f for f in reward_fns if not isinstance(f.fn, (TextRewardModel, GenerativeJudge))]
    if cfg.reward_workers == 0 or not pooled:
        return None
    return RewardPool(
        pooled,
        PoolConfig(
            num_workers=cfg.reward_workers,
            timeout_s=cfg.reward_timeout_s,
            chunk_size=cfg.reward_chunk_size,
        ),
    )


def reward_model_mesh(mesh: Mesh) -> Mesh:
    """Where a reward model runs on a run's ``mesh``: the mesh itself in one process; with several,
    this process's own devices (``fsdp`` over them), since the host reward scores this process's
    rows: each process holds the reward model once, split over its devices."""
    if not multi_process():
        return mesh
    return make_mesh("fsdp=-1", jax.local_devices())


def reward_functions(cfg: OnlineRunConfig, mesh: Mesh | None = None) -> list[RewardFunction]:
    """``--reward`` (with ``--reward-weights``) and ``--reward-model`` as weighted reward functions.

    The reward model's weights are an argument of its compiled scorer (``TextRewardModel``). On a
    ``mesh`` they are laid out by the sharding rules (``relax.parallel``), so a reward model
    larger than one device fits as the policy does (``reward_model_mesh``)."""
    weights = cfg.reward_weights or (1.0,) * len(cfg.reward)
    fns = [
        RewardFunction(reward_function(cfg, n), name=n, weight=w)
        for n, w in zip(cfg.reward, weights)
    ]
    if cfg.reward_model is not None:
        with on_host_memory(mesh is not None):
            model = load_reward_model(cfg.reward_model)
        if mesh is not None:
            rm_mesh = reward_model_mesh(mesh)
            model = jax.device_put(model, state_shardings(model, rm_mesh))
        rm = TextRewardModel(model, load_tokenizer(cfg.reward_model))
        fns.append(RewardFunction(rm, name="reward_model", weight=cfg.reward_model_weight))
    if cfg.judge.enabled:
        fns.append(RewardFunction(judge_reward(cfg, mesh), name="judge", weight=cfg.judge.weight))
    return fns


def judge_model_path(cfg: OnlineRunConfig) -> str:
    """``--judge.model``'s directory; "policy": the policy's base (``--model``, or the built-in
    task's ``<run dir>/base_model``, written before the reward functions are built)."""
    if cfg.judge.model != "policy":
        return cfg.judge.model
    return str(Path(cfg.run_dir) / "base_model") if cfg.model is None else cfg.model


def judge_reward(cfg: OnlineRunConfig, mesh: Mesh | None = None) -> GenerativeJudge:
    """``--judge.*``'s judge: over HTTP with ``--judge.url``; else the ``--judge.model`` loaded in
    the run's dtypes and, on a ``mesh``, laid out by the sharding rules on ``reward_model_mesh``
    (as a reward model is), sampling there. Unscorable samples follow ``--reward-on-error``."""
    if cfg.judge.url is not None:
        return http_judge(cfg.judge, answer_field=cfg.answer_field, on_error=cfg.reward_on_error)
    path = judge_model_path(cfg)
    with on_host_memory(mesh is not None):
        model = load_pretrained(
            path, dtype=DTYPES[cfg.compute_dtype], param_dtype=DTYPES[cfg.param_dtype]
        )
    if mesh is not None:
        model = jax.device_put(model, state_shardings(model, reward_model_mesh(mesh)))
    return device_judge(
        cfg.judge,
        model,
        load_tokenizer(path),
        answer_field=cfg.answer_field,
        on_error=cfg.reward_on_error,
        seed=cfg.seed,
    )
