"""The trainers ``relax plan`` knows (``ALGORITHMS``): how each parses its flags, builds its
algorithm and has its programs compiled and measured.

Online: ``grpo``, ``ppo`` (``relax.plan.measure.online``; ``--reward-model`` adds the reward
model, ``relax.plan.reward_model``). Offline, on the same meshes (``relax.plan.measure.offline``):
``sft``; ``dpo``, ``ipo``, ``simpo`` and ``orpo`` (the DPO family's losses, ``--dpo.*``); ``kto``;
``rm`` (a reward model); ``distill`` (the student ``--model`` and the teacher ``--teacher``, read
from its ``config.json`` in its stored dtype). Multi-turn: ``agent`` (``relax.plan.agent``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from relax.algorithms.distill import run as distill_run
from relax.algorithms.distill.step import init_distill_state
from relax.algorithms.dpo import run as dpo_run
from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.grpo import run as grpo_run
from relax.algorithms.kto import run as kto_run
from relax.algorithms.offline.run import OfflineAlgorithm
from relax.algorithms.online.config import ModelRunConfig
from relax.algorithms.ppo import run as ppo_run
from relax.algorithms.reward_model import run as reward_model_run
from relax.algorithms.sft import run as sft_run
from relax.models.decoder.transformer import init as init_model
from relax.models.hf.checkpoint import read_config
from relax.plan import agent
from relax.plan.checkpoints import stored_dtype
from relax.plan.measure import Measured, offline, online


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """How to parse an algorithm's flags (``config``, defaults ``builtin`` / ``real`` as
    ``parse_flags`` takes them), build it (``algorithm``: run config -> ``OnlineAlgorithm`` |
    ``OfflineAlgorithm``) and compile and measure its programs (``measure``: one of
    ``relax.plan.measure.online`` / ``offline``, ``relax.plan.agent.measured``). ``field``: its
    config's field in the run config (``grpo``: ``--grpo.*``); None: the run's ``--algorithm``
    names it (the agent: ``grpo`` or ``ppo``)."""

    config: type
    builtin: Callable[[], ModelRunConfig]
    real: Callable[[], ModelRunConfig]
    algorithm: Callable[[Any], Any]
    field: str | None
    measure: Callable[..., list[Measured]]

    def settings(self, run: ModelRunConfig) -> Any:
        """The algorithm's config in ``run`` (``run.grpo``, ``run.dpo``, ...)."""
        return getattr(run, run.algorithm if self.field is None else self.field)

    def flag(self, run: ModelRunConfig, name: str) -> str:
        """The command-line flag of the algorithm config's option ``name`` (``--grpo.remat``)."""
        field = run.algorithm if self.field is None else self.field
        return f"--{field.replace('_', '-')}.{name}"


def distill_algorithm(cfg: distill_run.DistillRunConfig) -> OfflineAlgorithm:
    """Distillation as a plan builds it: the run's own algorithm, its teacher (``--teacher``) made
    from the teacher's ``config.json`` in its stored dtype and the student's compute dtype (as
    ``load_teacher`` loads it) instead of read from its weights."""
    teacher, dtype, d = read_config(cfg.teacher), stored_dtype(cfg.teacher), cfg.distill

    def make_state(student, key):
        model = init_model(teacher, key, param_dtype=dtype, dtype=student.dtype)
        return init_distill_state(student, model, d.optimizer.make(), key=key)

    return dataclasses.replace(distill_run.algorithm(cfg), make_state=make_state)


def _dpo_family(loss_type: str) -> AlgorithmEntry:
    """A DPO-family loss (``--dpo.loss-type``) as its own algorithm name."""
    return AlgorithmEntry(
        dpo_run.DPORunConfig,
        lambda: dpo_run.builtin_defaults(loss_type),
        lambda: dpo_run.DPORunConfig(dpo=DPOConfig(loss_type=loss_type)),
        dpo_run.algorithm,
        "dpo",
        offline,
    )


ALGORITHMS = {
    "grpo": AlgorithmEntry(
        grpo_run.GRPORunConfig,
        grpo_run.builtin_defaults,
        grpo_run.real_defaults,
        grpo_run.algorithm,
        "grpo",
        online,
    ),
    "ppo": AlgorithmEntry(
        ppo_run.PPORunConfig,
        ppo_run.builtin_defaults,
        ppo_run.real_defaults,
        ppo_run.algorithm,
        "ppo",
        online,
    ),
    "sft": AlgorithmEntry(
        sft_run.SFTRunConfig,
        sft_run.builtin_defaults,
        sft_run.SFTRunConfig,
        sft_run.algorithm,
        "sft",
        offline,
    ),
    "dpo": _dpo_family("sigmoid"),
    "ipo": _dpo_family("ipo"),
    "simpo": _dpo_family("simpo"),
    "orpo": _dpo_family("orpo"),
    "kto": AlgorithmEntry(
        kto_run.KTORunConfig,
        kto_run.builtin_defaults,
        kto_run.KTORunConfig,
        kto_run.algorithm,
        "kto",
        offline,
    ),
    "rm": AlgorithmEntry(
        reward_model_run.RewardModelRunConfig,
        reward_model_run.builtin_defaults,
        reward_model_run.RewardModelRunConfig,
        reward_model_run.algorithm,
        "reward_model",
        offline,
    ),
    "distill": AlgorithmEntry(
        distill_run.DistillRunConfig,
        distill_run.builtin_defaults,
        distill_run.DistillRunConfig,
        distill_algorithm,
        "distill",
        offline,
    ),
    "agent": AlgorithmEntry(
        agent.AgentPlanConfig,
        agent.defaults,
        agent.defaults,
        agent.algorithm,
        None,
        agent.measured,
    ),
}
