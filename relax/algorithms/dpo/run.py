"""The DPO-family run (DPO, IPO, hinge, robust, SimPO, ORPO): ``run(cfg)`` is what
``examples/train_dpo.py`` and ``examples/train_orpo.py`` call. Model, data, checkpoints, logs and
the loop are ``relax.algorithms.offline.run``'s. Held-out figures: TRL's pair metrics
(``rewards/accuracies``: the share of pairs the policy ranks like the data, ``rewards/margins``,
...) and, where the chosen responses are strings, ``win_rate``: the share of held-out prompts
whose greedy completion IS the chosen response."""

from __future__ import annotations

import dataclasses
import functools

from relax.algorithms.dpo import step as dpo
from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.images import with_prompt
from relax.algorithms.offline.images import ImageTrainer
from relax.algorithms.offline.run import (
    OfflineAlgorithm,
    OfflineRunConfig,
    greedy_accuracy,
    run_offline,
)
from relax.algorithms.preference.config import make_state
from relax.algorithms.preference.reference_cache import reference_preparer
from relax.data.image_prompts import ImagePrompts
from relax.data.image_rows import encode_image_pairs
from relax.data.pairs import Pair
from relax.tasks import reverse


@dataclasses.dataclass(frozen=True)
class DPORunConfig(OfflineRunConfig):
    """A DPO-family run (every ``OfflineRunConfig`` flag, plus ``--dpo.*``)."""

    dpo: DPOConfig = DPOConfig()
    eval_max_new_tokens: int = 64
    run_dir: str = "runs/dpo"


def builtin_defaults(loss_type: str = "sigmoid") -> DPORunConfig:
    """The no-argument run: the reverse task's pairs (reverse chosen, copy rejected) on its base model."""
    lr = 3e-4 if loss_type == "orpo" else 5e-5  # ORPO's NLL term keeps the chosen likelihood up
    d = DPOConfig(
        loss_type=loss_type,
        max_prompt_tokens=16,
        max_completion_tokens=8,
        optimizer=dataclasses.replace(DPOConfig().optimizer, learning_rate=lr),
    )
    return DPORunConfig(
        dpo=d,
        steps=60,
        batch_size=16,
        eval_every=20,
        checkpoint_every=20,
        eval_max_new_tokens=8,
        run_dir=f"runs/{'orpo' if loss_type == 'orpo' else 'dpo'}-reverse",
    )


def image_trainer(cfg: DPORunConfig, images: ImagePrompts) -> ImageTrainer:
    """The DPO family on prompts with images (``relax.algorithms.offline.images``): pairs from
    ``relax.data.image_rows``, each prompt's images encoded once for both completions, the
    held-out pair metrics (``relax.algorithms.dpo.images``)."""
    d = cfg.dpo
    if d.precompute_reference:
        raise ValueError(
            "--dpo.precompute-reference: the cached reference log-probs are for text prompts; "
            "with --image-field the reference model runs in the step"
        )

    def encode(records, tokenizer):
        return encode_image_pairs(
            records,
            tokenizer,
            images,
            max_prompt_tokens=d.max_prompt_tokens,
            max_completion_tokens=d.max_completion_tokens,
        )

    def evaluate(state, held_out, tokenizer, encoder):
        _, pairs = held_out
        out = dpo.evaluate(
            d,
            state,
            pairs,
            pad_id=tokenizer.pad_token_id,
            batch_size=cfg.batch_size,
            images=images,
            encode=encoder,
        )
        out = {
            k: v
            for k, v in out.items()
            if k.startswith(("rewards/", "logps/")) or k in ("loss", "nll")
        }
        out["preference_accuracy"] = out["rewards/accuracies"]
        return out

    return ImageTrainer(
        encode=encode,
        collate=lambda pairs, pad_id: dpo.collate_images(d, pairs, pad_id, images),
        attach=with_prompt,
        make_step=lambda passes, tokenizer: dpo.make_dpo_step(d, passes),
        evaluate=evaluate,
        notes=(
            "pairs with images: not packed (padded prompts and completions); the vision tower "
            "frozen, run once per prompt for both completions",
            "held-out pairs with images: pair metrics only (no greedy win rate)",
        ),
    )


def algorithm(cfg: DPORunConfig) -> OfflineAlgorithm:
    d = cfg.dpo

    def encode_eval(records, tokenizer):
        return records, dpo.encode(d, records, tokenizer)

    def evaluate(state, held_out, tokenizer):
        records, pairs = held_out
        out = dpo.evaluate(
            d, state, pairs, pad_id=tokenizer.pad_token_id, batch_size=cfg.batch_size
        )
        out = {
            k: v
            for k, v in out.items()
            if k.startswith(("rewards/", "logps/")) or k in ("loss", "nll")
        }
        out["preference_accuracy"] = out["rewards/accuracies"]  # in the summary table (no "/")
        if all(isinstance(r.record.get("chosen"), str) for r in records):
            out["win_rate"] = greedy_accuracy(
                state.policy,
                tokenizer,
                records,
                max_new_tokens=cfg.eval_max_new_tokens,
                answer_field="chosen",
            )
        return out

    return OfflineAlgorithm(
        name="orpo" if d.loss_type == "orpo" else "dpo",
        make_state=functools.partial(make_state, d),
        make_step=lambda passes, tokenizer: dpo.make_dpo_step(d, passes),
        encode=functools.partial(dpo.encode, d),
        collate=functools.partial(dpo.collate, d),
        evaluate=evaluate,
        encode_eval=encode_eval,
        prepare=reference_preparer(d),
        builtin_data=lambda task, directory, tokenizer: reverse.write_task_data(
            task, directory, reverse.preference_records
        ),
        bar_keys=(("loss", "loss"), ("rewards/accuracies", "acc"), ("rewards/margins", "margin")),
        longest=lambda n: dpo.collate(
            d,
            [
                Pair(
                    prompt=[1] * d.max_prompt_tokens,
                    chosen=[1] * d.max_completion_tokens,
                    rejected=[1] * d.max_completion_tokens,
                    file="plan",
                    row=i,
                )
                for i in range(n)
            ],
            0,
        ),
        images=functools.partial(image_trainer, cfg),
    )


def run(cfg: DPORunConfig) -> dict:
    return run_offline(cfg, algorithm(cfg))
