"""Three-stage RLHF: SFT on demonstrations -> a reward model on preference pairs -> PPO (or GRPO)
against that reward model. ``run(cfg)`` is what ``examples/rlhf.py`` calls.

Each stage is the library's own run (``relax.algorithms.{sft,reward_model,ppo,grpo}.run``), every
flag of it under its prefix (``--sft.steps``, ``--reward-model.reward-model.optimizer.learning-rate``,
``--ppo.ppo.kl-coef``), in its own directory under ``--run-dir`` (``sft/``, ``reward_model/``,
``ppo/`` or ``grpo/``). The pipeline sets what chains them, and a stage flag for one of those is an
error (``OWNED``): stage 1 starts from ``--model`` (or the built-in task's base model), stages 2
and 3 from stage 1's export (``sft/final_hf``), stage 3's reward is stage 2's export
(``reward_model/final_hf``, as its ``--reward-model``), and the data is ``--data``'s
(``DATA_FILES``) or the built-in reverse task's (options ``--sft.reverse.*``; stages 2 and 3 read
it from ``run_dir/data``).

The summary (printed, returned, written to ``run_dir/summary.json``) is ``{"run_dir", "algorithm",
"stages": [{"stage", "run_dir", "export", "figures": [{"metric", "what", "better", "before",
"after"}, ...]}, ...]}``: each stage's held-out figures before and after it (``FIGURES``), every
one higher-is-better (``better``): SFT's greedy exact-match accuracy (rows with an answer) and
log-likelihood per completion token (-NLL); the reward model's pair accuracy; stage 3's
reward-model score of greedy and of sampled completions and, where the held-out prompts have
answers, the verifier's greedy exact-match accuracy (the policy learnt the task, not only what
the reward model likes).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Literal

from relax.algorithms.grpo import run as grpo_run
from relax.algorithms.offline.run import greedy_accuracy
from relax.algorithms.ppo import run as ppo_run
from relax.algorithms.reward_model import run as rm_run
from relax.algorithms.sft import run as sft_run
from relax.data.files import read_records
from relax.models.config.model import DTYPES
from relax.models.hf.checkpoint import load_pretrained
from relax.parallel import ParallelConfig
from relax.tasks import reverse
from relax.tasks.base import write_jsonl
from relax.text import load_tokenizer
from relax.train.logs import write_summary

STAGES = (
    "sft",
    "reward_model",
    "policy",
)  # stage 3 is "policy" here, "ppo" / "grpo" in the summary
DATA_FILES = {"sft": "sft.jsonl", "reward_model": "preferences.jsonl", "policy": "prompts.jsonl"}
"""``--data DIR``'s files: demonstrations (SFT rows), preference pairs, prompts (an ``answer`` column
gives the verifier's figure); beside each, an optional held-out ``<name>.eval.jsonl``."""
OWNED = ("model", "data", "eval_data", "run_dir", "parallel")  # a stage's fields the pipeline sets
HINTS = {
    "reverse": "; the built-in task's options are --sft.reverse.*",
    "parallel": "; --parallel.* lays out every stage",
}
OWNED_LATER = ("task", "reverse")  # stages 2 and 3: their data is the pipeline's too
FIGURES = {
    "sft": (
        ("greedy/accuracy", "greedy exact-match accuracy"),
        ("log_likelihood", "log-likelihood per completion token (-NLL)"),
    ),
    "reward_model": (("pair_accuracy", "pair accuracy (chosen scored above rejected)"),),
    "policy": (
        ("greedy/reward", "reward-model score, greedy completions"),
        ("reward", "reward-model score, sampled completions"),
        ("verifier/accuracy", "verifier: greedy exact-match accuracy"),
    ),
}


@dataclasses.dataclass(frozen=True)
class RLHFRunConfig:
    """The pipeline's own flags, and each stage's run config under its prefix (module docstring)."""

    model: str | None = None
    """The initial policy (an HF directory); without it, the built-in reverse task's base model."""
    data: str | None = None
    """With --model: a directory of sft.jsonl, preferences.jsonl and prompts.jsonl, each with an optional
    held-out <name>.eval.jsonl beside it (else the stage holds out its --X.eval-fraction)."""
    run_dir: str = "runs/rlhf-reverse"
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """Stage 3's algorithm; its flags are --ppo.* or --grpo.*."""
    sft: sft_run.SFTRunConfig = sft_run.SFTRunConfig()
    reward_model: rm_run.RewardModelRunConfig = rm_run.RewardModelRunConfig()
    ppo: ppo_run.PPORunConfig = ppo_run.PPORunConfig()
    grpo: grpo_run.GRPORunConfig = grpo_run.GRPORunConfig()
    parallel: ParallelConfig = ParallelConfig()
    """Every stage's meshes and multi-host setup (``relax.parallel``), e.g. ``--parallel.mesh
    data=2,fsdp=2,tensor=2``: the three stages run on the same devices, one after the other."""

    def __post_init__(self):
        if (self.model is None) != (self.data is None):
            raise ValueError(
                "--model and --data go together (without both: the built-in reverse task)"
            )


def _placed(cfg: RLHFRunConfig) -> RLHFRunConfig:
    """``cfg`` with each stage's --X.run-dir default saying where the pipeline puts it."""
    return dataclasses.replace(
        cfg,
        **{
            name: dataclasses.replace(getattr(cfg, name), run_dir=f"<--run-dir>/{name}")
            for name in ("sft", "reward_model", "ppo", "grpo")
        },
    )


def _rate(algo_cfg, learning_rate: float):
    return dataclasses.replace(
        algo_cfg, optimizer=dataclasses.replace(algo_cfg.optimizer, learning_rate=learning_rate)
    )


def builtin_defaults() -> RLHFRunConfig:
    """The no-argument run on the reverse task, sized so that every stage has room to show: 8 SFT
    steps on right answers at a low rate (the policy only starts to prefer reversing), a reward model of
    the right answer over varied wrong ones (``builtin_pairs``), then 40 steps of PPO / GRPO on
    that reward model alone, at a lower rate and with a firmer KL than their own demos: a learnt
    reward is gamed sooner than a verifier (GRPO's held-out verifier accuracy, 0.515 after SFT,
    was 0.845 at step 20 and 0.72 at step 40 with beta 0.2; 0.61 at step 40 with the preset's 0.04)."""
    sft, rm = sft_run.builtin_defaults(), rm_run.builtin_defaults()
    ppo, grpo = ppo_run.builtin_defaults("reverse"), grpo_run.builtin_defaults("grpo", "reverse")
    return _placed(
        RLHFRunConfig(
            sft=dataclasses.replace(sft, steps=8, eval_every=0, sft=_rate(sft.sft, 1e-4)),
            reward_model=dataclasses.replace(
                rm, steps=400, batch_size=32, eval_every=100, checkpoint_every=100
            ),
            ppo=dataclasses.replace(
                ppo, steps=40, reward=(), ppo=_rate(dataclasses.replace(ppo.ppo, kl_coef=0.1), 3e-4)
            ),
            grpo=dataclasses.replace(
                grpo,
                steps=40,
                reward=(),
                grpo=_rate(dataclasses.replace(grpo.grpo, beta=0.2), 3e-4),
            ),
        )
    )


def real_defaults() -> RLHFRunConfig:
    """``--model`` runs: each stage's own defaults; stage 3's reward is the reward model alone, and
    5% of the prompts are held out (for its before/after) unless prompts.eval.jsonl is given."""
    return _placed(
        RLHFRunConfig(
            ppo=dataclasses.replace(ppo_run.real_defaults(), reward=(), eval_fraction=0.05),
            grpo=dataclasses.replace(grpo_run.real_defaults(), reward=(), eval_fraction=0.05),
        )
    )


def stages(cfg: RLHFRunConfig) -> list[tuple[str, Any, Any]]:
    """``[(name, stage config, its run function)]``, chained (module docstring). A stage flag the
    pipeline owns (set away from its default) or a missing data file is an error, before any compute."""
    root, builtin, third = Path(cfg.run_dir), cfg.model is None, cfg.algorithm
    default = builtin_defaults() if builtin else real_defaults()
    for i, name in enumerate(("sft", "reward_model", third)):
        owned = OWNED + (OWNED_LATER if i else ()) + (("reward_model",) if i == 2 else ())
        for field in owned:
            if getattr(getattr(cfg, name), field) != getattr(getattr(default, name), field):
                raise ValueError(
                    f"--{name}.{field}".replace("_", "-")
                    + " is set by the RLHF pipeline (from --model, "
                    "--data, --run-dir, --parallel.* and the stage before); leave it out"
                    + HINTS.get(field, "")
                )
    data = root / "data" if builtin else Path(cfg.data)

    def files(stage: str) -> dict:
        train = data / DATA_FILES[stage]
        held_out = train.with_suffix(".eval.jsonl")
        if not builtin and not train.is_file():
            raise FileNotFoundError(
                f"--data {cfg.data} has no {train.name} (it needs {', '.join(DATA_FILES.values())})"
            )
        return {
            "data": str(train),
            "eval_data": str(held_out) if builtin or held_out.is_file() else None,
        }

    sft_out = str(root / "sft" / "final_hf")
    first = dataclasses.replace(
        cfg.sft,
        run_dir=str(root / "sft"),
        parallel=cfg.parallel,
        **({} if builtin else {"model": cfg.model, **files("sft")}),
    )
    second = dataclasses.replace(
        cfg.reward_model,
        run_dir=str(root / "reward_model"),
        model=sft_out,
        parallel=cfg.parallel,
        **files("reward_model"),
    )
    policy = dataclasses.replace(
        getattr(cfg, third),
        run_dir=str(root / third),
        model=sft_out,
        parallel=cfg.parallel,
        reward_model=str(root / "reward_model" / "final_hf"),
        **files("policy"),
    )
    return [
        ("sft", first, sft_run.run),
        ("reward_model", second, rm_run.run),
        (third, policy, ppo_run.run if third == "ppo" else grpo_run.run),
    ]


def write_builtin_data(task: reverse.ReverseTask, directory: Path) -> None:
    """The reverse task as ``--data`` files for stages 2 and 3: preference pairs (``builtin_pairs``)
    and prompts with their answers (stage 1 writes its own rows, ``reverse.sft_records``)."""
    train, held_out = reverse.make_splits(task)
    for seed, (rows, suffix) in enumerate(((train, ".jsonl"), (held_out, ".eval.jsonl"))):
        write_jsonl(builtin_pairs(task, rows, seed), directory / f"preferences{suffix}")
        write_jsonl(rows, directory / f"prompts{suffix}")


def builtin_pairs(
    task: reverse.ReverseTask, records: list[dict], seed: int, copy_share: float = 0.3
) -> list[dict]:
    """One pair per record, the right answer chosen; rejected: the copy (the base model's mistake,
    ``copy_share`` of them) or another wrong answer (a letter changed, dropped or added, two
    neighbours swapped, the letters shuffled, a random string). Against the copy alone
    (``reverse.preference_records``) the reward model scores many other wrong strings high, and PPO
    (its demo's settings, after 4 SFT steps at 1e-3) found them: held-out verifier accuracy
    0.785 -> 0.0, on completions such as ``eehh``."""
    rng = random.Random(seed)
    return [
        {
            "prompt": r["prompt"],
            "chosen": r["answer"],
            "rejected": reverse.copy_of(r)
            if rng.random() < copy_share
            else _wrong(r["answer"], task.alphabet, rng),
        }
        for r in records
    ]


def _wrong(answer: str, alphabet: str, rng: random.Random) -> str:
    s, i, kind = list(answer), rng.randrange(len(answer)), rng.randrange(6)
    if kind == 0:
        s[i] = rng.choice([c for c in alphabet if c != s[i]])
    elif kind == 1:
        del s[i]
    elif kind == 2:
        s.insert(i, rng.choice(alphabet))
    elif kind == 3 and i + 1 < len(s):
        s[i], s[i + 1] = s[i + 1], s[i]
    elif kind == 4:
        rng.shuffle(s)
    else:
        s = [rng.choice(alphabet) for _ in s]
    return "".join(s) if s != list(answer) else _wrong(answer, alphabet, rng)


def verifier_accuracy(policy_dir: str, cfg, records) -> float:
    """Greedy exact-match accuracy of the policy in ``policy_dir`` on the held-out prompt ``records``
    (stage 3's config ``cfg``: dtypes, prompt and answer columns, completion budget)."""
    policy = load_pretrained(
        policy_dir,
        dtype=DTYPES[cfg.compute_dtype],
        param_dtype=DTYPES[cfg.param_dtype],
        precision=cfg.precision,
    )
    generation = (cfg.ppo if isinstance(cfg, ppo_run.PPORunConfig) else cfg.grpo).generation
    return greedy_accuracy(
        policy,
        load_tokenizer(policy_dir),
        records,
        max_new_tokens=generation.max_new_tokens,
        prompt_field=cfg.prompt_field,
        answer_field=cfg.answer_field,
    )


def figures(stage: str, summary: dict, extra: dict | None = None) -> list[dict]:
    """The ``FIGURES`` of ``stage`` from its run's summary (``extra``: ``{metric: (before, after)}``
    computed here), each ``{metric, what, better, before, after}``; none is an error."""
    before, after = dict(summary.get("before") or {}), dict(summary.get("after") or {})
    for d in (before, after):
        if "nll" in d:
            d["log_likelihood"] = -d["nll"]
    for key, (b, a) in (extra or {}).items():
        before[key], after[key] = b, a
    out = [
        {
            "metric": key,
            "what": what,
            "better": "higher",
            "before": before[key],
            "after": after[key],
        }
        for key, what in FIGURES[stage]
        if key in before and key in after
    ]
    if not out:
        raise RuntimeError(
            f"no held-out figure was recorded (held-out rows? --eval-only?); summary keys: "
            f"{sorted(summary)}"
        )
    return out


def stages_table(result: dict) -> str:
    lines = [
        f"RLHF ({result['run_dir']}): held-out figures before and after each stage, all higher-is-better",
        f"{'stage':<14}{'metric':<44}{'before':>9}{'after':>9}{'change':>9}",
    ]
    for stage in result["stages"]:
        lines += [
            f"{stage['stage']:<14}{f['what']:<44}{f['before']:>9.3f}{f['after']:>9.3f}"
            f"{f['after'] - f['before']:>+9.3f}"
            for f in stage["figures"]
        ]
    return "\n".join(lines)


def run(cfg: RLHFRunConfig, log=print) -> dict:
    """The three stages in order; returns the summary (module docstring), also written to
    ``run_dir/summary.json`` after each stage. A stage that fails stops the pipeline, its error
    naming the stage."""
    plan = stages(cfg)
    root = Path(cfg.run_dir)
    if cfg.model is None:
        write_builtin_data(cfg.sft.reverse, root / "data")
    result: dict = {"run_dir": str(root), "algorithm": cfg.algorithm, "stages": []}
    for i, ((name, stage_cfg, run_stage), role) in enumerate(zip(plan, STAGES), 1):
        log(
            f"\n=== RLHF stage {i}/3: {name}, from {stage_cfg.model or 'the built-in base model'}, "
            f"in {stage_cfg.run_dir}"
        )
        try:
            summary = run_stage(stage_cfg)
            export = summary.get("export")
            if export is None or not (Path(export) / "config.json").is_file():
                raise RuntimeError(
                    f"no exported model for the next stage in {stage_cfg.run_dir}/final_hf "
                    "(--no-export-hf?)"
                )
            extra = None
            if role == "policy" and stage_cfg.eval_data is not None:
                records = read_records(stage_cfg.eval_data)[: stage_cfg.eval_max_prompts]
                if all(stage_cfg.answer_field in r.record for r in records):
                    extra = {
                        "verifier/accuracy": (
                            verifier_accuracy(stage_cfg.model, stage_cfg, records),
                            verifier_accuracy(export, stage_cfg, records),
                        )
                    }
            result["stages"].append(
                {
                    "stage": name,
                    "run_dir": stage_cfg.run_dir,
                    "export": export,
                    "figures": figures(role, summary, extra),
                }
            )
        except Exception as e:
            e.add_note(f"RLHF stage {i}/3 ({name}) failed; its run directory: {stage_cfg.run_dir}")
            log(f"RLHF stage {i}/3 ({name}) failed: {type(e).__name__}: {e}")
            raise
        write_summary(root, result)
    log("\n" + stages_table(result))
    return result
