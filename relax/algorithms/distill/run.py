"""The distillation run: ``run(cfg)`` is what ``examples/train_distill.py`` calls. The student is
``--model`` (the policy: trained, evaluated, exported), the teacher ``--teacher`` (kept as the
state's reference, never updated). Rows are ``prompt``/``completion`` (off-policy: the dataset's
completions; on-policy: the student's own samples of the prompts). Held-out figures: the
student's divergence to the teacher and their top-1 agreement on the held-out completions."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.cli.configure import configure
from relax.algorithms.distill.config import DistillConfig
from relax.algorithms.distill.data import DistillBatch, collate_completions
from relax.algorithms.distill.step import init_distill_state, load_teacher, make_distill_step
from relax.algorithms.offline.run import OfflineAlgorithm, PairRunConfig, run_offline
from relax.algorithms.online.setup import with_lora
from relax.data.supervised import encode_sft
from relax.masked import masked_mean
from relax.models.adapters.operations import lora_off
from relax.models.decoder.transformer import init
from relax.models.forward.prefix_shared import completion_hidden
from relax.models.heads.distill import divergence_from_hidden
from relax.tasks import reverse


@dataclasses.dataclass(frozen=True)
class DistillRunConfig(PairRunConfig):
    """A distillation run (every ``PairRunConfig`` flag, plus ``--teacher`` and ``--distill.*``)."""

    teacher: str | None = None
    """The teacher's HF directory (required with --model; same vocabulary as the student)."""
    distill: DistillConfig = DistillConfig()
    builtin_student_hidden_size: int = 32
    """Built-in task: the student is a fresh model of this width; the teacher, the task's base model."""
    run_dir: str = "runs/distill"

    def __post_init__(self):
        super().__post_init__()
        if self.model is not None and self.teacher is None:
            raise ValueError("--model (the student) needs --teacher")


def builtin_defaults() -> DistillRunConfig:
    """The no-argument run: a fresh small student learns the reverse task's base model."""
    d = configure(
        DistillConfig,
        max_new_tokens=8,
        optimizer=dataclasses.replace(DistillConfig().optimizer, learning_rate=3e-3),
    )
    return DistillRunConfig(
        distill=d,
        steps=100,
        batch_size=16,
        max_prompt_tokens=16,
        max_completion_tokens=8,
        eval_every=50,
        checkpoint_every=50,
        run_dir="runs/distill-reverse",
    )


@eqx.filter_jit
def _held_out(student, teacher, batch: DistillBatch, div: str, beta: float, temperature: float):
    args = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask)
    d, agree, _ = divergence_from_hidden(
        student,
        completion_hidden(student, *args),
        teacher,
        completion_hidden(teacher, *args),
        divergence=div,
        beta=beta,
        temperature=temperature,
    )
    m = batch.mask > 0
    return masked_mean(d, m), masked_mean(agree, m)


def algorithm(cfg: DistillRunConfig) -> OfflineAlgorithm:
    d = cfg.distill

    def make_state(model, key):
        if cfg.model is None:  # the built-in task: the base model teaches a fresh, smaller student
            k_init, key = jax.random.split(key)
            width = cfg.builtin_student_hidden_size
            student = init(
                dataclasses.replace(
                    model.config,
                    hidden_size=width,
                    intermediate_size=2 * width,
                    head_dim=width // model.config.num_heads,
                ),
                k_init,
                std=0.05,
            )
            # --lora applies to the student; the teacher is the base model as loaded
            return init_distill_state(
                with_lora(cfg, student), lora_off(model), d.optimizer.make(), key=key
            )
        return init_distill_state(
            model, load_teacher(cfg.teacher, model), d.optimizer.make(), key=key
        )

    def encode(records, tokenizer):
        """(prompt, completion) token lists of supervised rows (``relax.data.supervised.encode_sft``):
        the prompt is what precedes the first loss token."""
        out = []
        for e in encode_sft(
            records, tokenizer, max_length=cfg.max_prompt_tokens + cfg.max_completion_tokens
        ):
            start = int(np.argmax(np.asarray(e.loss_mask) > 0))
            prompt, completion = list(e.ids[:start]), list(e.ids[start:])
            if len(prompt) > cfg.max_prompt_tokens or len(completion) > cfg.max_completion_tokens:
                raise ValueError(
                    f"{e.origin}: {len(prompt)} prompt / {len(completion)} completion tokens exceed "
                    f"--max-prompt-tokens {cfg.max_prompt_tokens} / --max-completion-tokens "
                    f"{cfg.max_completion_tokens}"
                )
            out.append((prompt, completion))
        return out

    def collate(examples, pad_id):
        return collate_completions(
            examples,
            pad_id=pad_id,
            prompt_length=cfg.max_prompt_tokens,
            completion_length=cfg.max_completion_tokens,
        )

    def evaluate(state, examples, tokenizer):
        div, agree = _held_out(
            state.policy,
            state.ref,
            jax.tree.map(jnp.asarray, collate(examples, tokenizer.pad_token_id)),
            d.divergence,
            d.jsd_beta,
            d.generation.temperature,
        )
        return {f"{d.metric_name}_to_teacher": float(div), "top1_accuracy": float(agree)}

    def make_step(passes, tokenizer):
        eos = tuple(sorted(tokenizer.eos_token_ids))
        return make_distill_step(d, passes, eos_ids=eos, pad_id=tokenizer.pad_token_id)

    return OfflineAlgorithm(
        name="distill",
        make_state=make_state,
        make_step=make_step,
        encode=encode,
        collate=collate,
        evaluate=evaluate,
        builtin_data=lambda task, dd, tokenizer: reverse.write_task_data(
            task,
            dd,
            lambda rs: [
                {k: r[k] for k in ("prompt", "completion")} for r in reverse.unpaired_records(rs, 0)
            ],
        ),
        bar_keys=(("loss", "loss"), ("top1_agreement", "agree")),
        longest=lambda n: collate(
            [([1] * cfg.max_prompt_tokens, [1] * cfg.max_completion_tokens)] * n, 0
        ),
    )


def run(cfg: DistillRunConfig) -> dict:
    return run_offline(cfg, algorithm(cfg))
