"""The KTO run: ``run(cfg)`` is what ``examples/train_kto.py`` calls. Rows are unpaired
``prompt``/``completion``/``label`` (true: desirable). Held-out figures: the KTO loss and
``rewards/*`` (the implicit reward of desirable and undesirable completions) and, where held-out
rows carry an ``answer``, ``win_rate``: the share of prompts whose greedy completion is it."""

from __future__ import annotations

import dataclasses
import functools

from relax.algorithms.kto import step as kto
from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.offline.run import (
    OfflineAlgorithm,
    OfflineRunConfig,
    greedy_accuracy,
    run_offline,
)
from relax.algorithms.preference.config import make_state
from relax.algorithms.preference.reference_cache import reference_preparer
from relax.data.pairs import Unpaired
from relax.tasks import reverse


@dataclasses.dataclass(frozen=True)
class KTORunConfig(OfflineRunConfig):
    """A KTO run (every ``OfflineRunConfig`` flag, plus ``--kto.*``)."""

    kto: KTOConfig = KTOConfig()
    answer_field: str = "answer"
    eval_max_new_tokens: int = 64
    run_dir: str = "runs/kto"


def builtin_defaults() -> KTORunConfig:
    """The no-argument run: reversals (desirable) and copies (undesirable) of the reverse task."""
    k = KTOConfig(
        max_prompt_tokens=16,
        max_completion_tokens=8,
        optimizer=dataclasses.replace(KTOConfig().optimizer, learning_rate=5e-5),
    )
    return KTORunConfig(
        kto=k,
        steps=60,
        batch_size=16,
        eval_every=20,
        checkpoint_every=20,
        eval_max_new_tokens=8,
        run_dir="runs/kto-reverse",
    )


def algorithm(cfg: KTORunConfig) -> OfflineAlgorithm:
    k = cfg.kto

    def encode_eval(records, tokenizer):
        return records, kto.encode(k, records, tokenizer)

    def evaluate(state, held_out, tokenizer):
        records, examples = held_out
        out = kto.evaluate(
            k, state, examples, pad_id=tokenizer.pad_token_id, batch_size=cfg.batch_size
        )
        if all(cfg.answer_field in r.record for r in records):
            out["win_rate"] = greedy_accuracy(
                state.policy,
                tokenizer,
                records,
                max_new_tokens=cfg.eval_max_new_tokens,
                answer_field=cfg.answer_field,
            )
        return out

    return OfflineAlgorithm(
        name="kto",
        make_state=functools.partial(make_state, k),
        make_step=lambda passes, tokenizer: kto.make_kto_step(k, passes),
        encode=functools.partial(kto.encode, k),
        collate=functools.partial(kto.collate, k),
        evaluate=evaluate,
        encode_eval=encode_eval,
        prepare=reference_preparer(k),
        builtin_data=lambda task, d, tokenizer: reverse.write_task_data(
            task, d, functools.partial(reverse.unpaired_records, seed=task.seed)
        ),
        bar_keys=(("loss", "loss"), ("kl", "kl"), ("rewards/margins", "margin")),
        longest=lambda n: kto.collate(
            k,
            [
                Unpaired(
                    prompt=[1] * k.max_prompt_tokens,
                    completion=[1] * k.max_completion_tokens,
                    kl_completion=[1] * k.max_completion_tokens,
                    desirable=i % 2 == 0,
                    file="plan",
                    row=i,
                    ref=(0.0, 0.0) if k.precompute_reference else None,
                )
                for i in range(n)
            ],
            0,
        ),
    )


def run(cfg: KTORunConfig) -> dict:
    return run_offline(cfg, algorithm(cfg))
