"""The reward-model run: ``run(cfg)`` is what ``examples/train_reward_model.py`` calls. Model,
data, checkpoints, logs and the loop are ``relax.algorithms.offline.run``'s; the export is a
sequence-classification HF directory (``relax.models.heads.reward_model.save_reward_model``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from relax.algorithms.offline.run import OfflineAlgorithm, PairRunConfig, run_offline
from relax.algorithms.online.setup import host_policy
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.step import (
    evaluate_pairs,
    init_reward_model_state,
    make_reward_model_step,
)
from relax.data.pairs import Pair, collate_pairs, encode_pairs
from relax.models.heads.reward_model import save_reward_model
from relax.tasks import reverse
from relax.train.logs import is_main_process


@dataclasses.dataclass(frozen=True)
class RewardModelRunConfig(PairRunConfig):
    """A reward-model run (every ``PairRunConfig`` flag, plus ``--reward-model.*``)."""

    reward_model: RewardModelConfig = RewardModelConfig()
    run_dir: str = "runs/reward_model"


def builtin_defaults() -> RewardModelRunConfig:
    """The no-argument run: pairs of the reverse task (reverse preferred to copy), a few minutes on CPU."""
    rm = RewardModelConfig(
        optimizer=dataclasses.replace(RewardModelConfig().optimizer, learning_rate=1e-3)
    )
    return RewardModelRunConfig(
        reward_model=rm,
        steps=60,
        batch_size=16,
        max_prompt_tokens=16,
        max_completion_tokens=8,
        eval_every=20,
        checkpoint_every=20,
        run_dir="runs/reward-model-reverse",
    )


def export(model, directory: Path, tokenizer) -> Path:
    """The reward model as a ``<Family>ForSequenceClassification`` directory with its tokenizer
    (collective: every process calls it; its shards are gathered, process 0 writes)."""
    model = host_policy(model)
    if is_main_process():
        save_reward_model(model, directory, tokenizer=tokenizer)
    return Path(directory)


def algorithm(cfg: RewardModelRunConfig) -> OfflineAlgorithm:
    budget = dict(
        max_prompt_tokens=cfg.max_prompt_tokens, max_completion_tokens=cfg.max_completion_tokens
    )

    def encode(records, tokenizer):
        return encode_pairs(records, tokenizer, truncate_prompt=cfg.truncate_prompt, **budget)

    def collate(pairs, pad_id):
        return collate_pairs(
            pairs,
            pad_id=pad_id,
            prompt_length=cfg.max_prompt_tokens,
            completion_length=cfg.max_completion_tokens,
        )

    def evaluate(state, pairs, tokenizer):
        metrics = evaluate_pairs(
            state.policy, collate(pairs, tokenizer.pad_token_id), pairs_per_pass=cfg.batch_size
        )
        return {"pair_accuracy": metrics["accuracy"], "margin": metrics["margin"]}

    return OfflineAlgorithm(
        name="reward_model",
        make_state=lambda model, key: init_reward_model_state(cfg.reward_model, model, key),
        make_step=lambda passes, tokenizer: make_reward_model_step(cfg.reward_model, passes),
        encode=encode,
        collate=collate,
        evaluate=evaluate,
        builtin_data=lambda task, d, tokenizer: reverse.write_task_data(
            task, d, reverse.preference_records
        ),
        export=export,
        bar_keys=(("loss", "loss"), ("accuracy", "acc")),
        longest=lambda n: collate(
            [
                Pair(
                    prompt=[1] * cfg.max_prompt_tokens,
                    chosen=[1] * cfg.max_completion_tokens,
                    rejected=[1] * cfg.max_completion_tokens,
                    file="plan",
                    row=i,
                )
                for i in range(n)
            ],
            0,
        ),
    )


def run(cfg: RewardModelRunConfig) -> dict:
    return run_offline(cfg, algorithm(cfg))
