"""The SFT run: ``run(cfg)`` is what ``examples/train_sft.py`` calls. Model, data, checkpoints,
logs and the loop are ``relax.algorithms.offline.run``'s. With ``--sft.packing`` (the default) the
examples are packed into rows of ``--sft.max-length`` tokens once, and ``--batch-size`` counts
rows; held-out rows are evaluated by greedy exact match of their ``answer`` when they have one,
else by their NLL."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.offline.run import (
    OfflineAlgorithm,
    OfflineRunConfig,
    greedy_accuracy,
    run_offline,
)
from relax.algorithms.sft.config import SFTConfig
from relax.algorithms.sft.images import image_sft_trainer
from relax.algorithms.sft.step import (
    init_sft_state,
    make_sft_step,
    sft_examples,
    sft_rows,
)
from relax.data.supervised import PackedBatch, SFTExample, stack_rows
from relax.models.forward.packed import packed_logprobs
from relax.passes import choose_passes
from relax.tasks import reverse


@dataclasses.dataclass(frozen=True)
class SFTRunConfig(OfflineRunConfig):
    """An SFT run (every ``OfflineRunConfig`` flag, plus ``--sft.*``)."""

    sft: SFTConfig = SFTConfig()
    answer_field: str = "answer"
    """Held-out rows with this column are scored by greedy exact match (``greedy/accuracy``)."""
    eval_max_new_tokens: int = 64
    run_dir: str = "runs/sft"


def builtin_defaults() -> SFTRunConfig:
    """The no-argument run: the reverse task's right answers as completions, on its base model."""
    sft = SFTConfig(
        max_length=32, optimizer=dataclasses.replace(SFTConfig().optimizer, learning_rate=1e-3)
    )
    return SFTRunConfig(
        sft=sft,
        steps=60,
        batch_size=8,
        eval_every=20,
        checkpoint_every=20,
        eval_max_new_tokens=8,
        run_dir="runs/sft-reverse",
    )


EVAL_ROWS = 16  # held-out rows per forward (the last chunk padded with empty rows: one compile)


@jax.jit
def _nll(policy, batch: PackedBatch):
    lp = packed_logprobs(policy, batch.ids, batch.segment_ids, block=choose_passes().rows_block())
    m = batch.loss_mask[:, 1:] > 0
    return -jnp.sum(jnp.where(m, lp, 0.0)), jnp.sum(m)


def held_out_nll(policy, rows: list[PackedBatch]) -> float:
    """Mean NLL per loss token of the held-out rows (``sft_rows``), ``EVAL_ROWS`` rows per forward."""
    empty = jax.tree.map(np.zeros_like, rows[0])  # no tokens, no loss
    total, count = 0.0, 0
    for start in range(0, len(rows), EVAL_ROWS):
        chunk = rows[start : start + EVAL_ROWS]
        s, n = _nll(policy, stack_rows(chunk + [empty] * (EVAL_ROWS - len(chunk))))
        total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def algorithm(cfg: SFTRunConfig) -> OfflineAlgorithm:
    def encode(records, tokenizer):
        return sft_rows(
            cfg.sft, sft_examples(cfg.sft, records, tokenizer), pad_id=tokenizer.pad_token_id
        )

    def encode_eval(records, tokenizer):
        return records, encode(records, tokenizer)

    def evaluate(state, held_out, tokenizer):
        policy, (records, rows) = state.policy, held_out
        out = {"nll": held_out_nll(policy, rows)}
        if all(cfg.answer_field in r.record for r in records):
            out["greedy/accuracy"] = greedy_accuracy(
                policy,
                tokenizer,
                records,
                max_new_tokens=cfg.eval_max_new_tokens,
                prompt_field=cfg.sft.prompt_field,
                answer_field=cfg.answer_field,
            )
        return out

    def host_metrics(out, metrics):
        return {"tokens_per_s": metrics["tokens"] / metrics["time/step"]}

    return OfflineAlgorithm(
        name="sft",
        make_state=lambda model, key: init_sft_state(cfg.sft, model, key=key),
        make_step=lambda passes, tokenizer: make_sft_step(cfg.sft, passes),
        encode=encode,
        collate=lambda rows, pad_id: stack_rows(rows),
        evaluate=evaluate,
        encode_eval=encode_eval,
        builtin_data=lambda task, d, tokenizer: reverse.write_task_data(
            task, d, reverse.sft_records
        ),
        host_metrics=host_metrics,
        bar_keys=(("loss", "loss"), ("accuracy", "acc"), ("tokens_per_s", "tok/s")),
        longest=lambda n: stack_rows(
            sft_rows(cfg.sft, [full_example(cfg.sft.max_length)] * n, pad_id=0)
        ),
        images=lambda images: image_sft_trainer(cfg.sft, images, batch_size=cfg.batch_size),
    )


def full_example(length: int) -> SFTExample:
    """An example filling a row of ``length`` tokens, every token but the first a target."""
    return SFTExample(
        ids=np.ones(length, np.int32),
        loss_mask=np.r_[0, np.ones(length - 1)].astype(np.int32),
        origin="plan",
    )


def run(cfg: SFTRunConfig) -> dict:
    return run_offline(cfg, algorithm(cfg))
