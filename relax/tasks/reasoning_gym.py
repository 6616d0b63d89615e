"""reasoning-gym's procedural tasks as a data source: ``--task reasoning_gym:<name>[,<name>...]``.

Rows are generated offline, before the run, by reasoning-gym itself: one task is
``reasoning_gym.create_dataset(name, seed=seed, size=size, **options)``, a mixture is its
``CompositeDataset`` (each row drawn from a task with probability ``weight / sum(weights)``). A
row is ``{"prompt": question, "answer": answer, "data_source": task name, "entry": the whole
reasoning-gym entry}``; the reward ``reasoning_gym`` (``relax.rewards.reasoning_gym``) scores a
completion with the row's own task's ``score_answer(extract_answer(completion), entry)``.

Held-out rows come from ``eval_seed``. reasoning-gym seeds item ``i`` of a dataset with seed
``s`` by ``Random(s + i)`` (a mixture's tasks by ``s + 1 + k``), so two seeds give disjoint
generators only when their ranges do not meet: ``[seed, seed + size + K]`` and ``[eval_seed,
eval_seed + eval_size + K]`` (K tasks) must not overlap, and held-out rows whose question is
also a training question are dropped (counted, with a warning).

Difficulty: ``level`` sets every attribute of each task's reasoning-gym curriculum to that level
(capped at the attribute's last), and ``options`` (``name.field=value``, JSON values) override the
generator's fields on top. With ``max_level`` the rows span levels ``level`` (0 when unset) to
``max_level``, ``size`` training and ``eval_size`` held-out rows per level, each level's seeds
after the previous level's; a row's ``level`` column holds its level and its ``data_source`` is
``<task>/level<k>`` (held-out metrics per task and level). The run then rises through them
(``relax.data.curriculum``). Without ``--model`` the run is a built-in task: a tiny Llama with a
sentencepiece tokenizer trained on the rows, taught by a noisy teacher that answers
``<answer>right</answer>`` with probability ``teacher_accuracy`` and otherwise another training
row's answer of the same task. reasoning-gym is imported only when a task is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings
from pathlib import Path
from typing import Annotated, Any

import jax
import numpy as np
import tyro

from relax.models.decoder.transformer import Transformer
from relax.rewards.reasoning_gym import ENTRY_FIELD, to_json
from relax.tasks.base import supervised_phase, tiny_llama
from relax.text import TextTokenizer, load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece

PREFIX = "reasoning_gym:"
ANSWER_TAGS = ("<answer>", "</answer>")  # reasoning-gym's extract_answer reads the last pair


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
    """What ``--task reasoning_gym:<names>`` generates, and (without ``--model``) its base model."""

    size: int = 2000
    """Training rows (generated with ``seed``)."""
    seed: int = 0
    eval_size: int = 100
    """Held-out rows (generated with ``eval_seed``; those repeating a training question dropped)."""
    eval_seed: int = 1_000_000
    weights: tuple[float, ...] = ()
    """A mixture's weight per task, in --task order (empty: all 1)."""
    options: tuple[str, ...] = ()
    """Generator options ``name.field=value`` (``field=value`` for one task); value is JSON, or a
    string: ``basic_arithmetic.max_digits=2 basic_arithmetic.operators='["+","-"]'``."""
    level: int | None = None
    """Difficulty: every attribute of each task's reasoning-gym curriculum at this level (with
    --reasoning-gym.max-level: the first level)."""
    max_level: int | None = None
    """A rising curriculum (GRPO / PPO): rows at every level from --reasoning-gym.level (0 when
    unset) to this one, the batches from the first until its mean training reward over
    --reasoning-gym.level-window updates reaches --reasoning-gym.level-up-at, then the next."""
    level_up_at: float = 0.8
    """With --reasoning-gym.max-level: the mean training reward that moves the run up a level."""
    level_window: int = 10
    """With --reasoning-gym.max-level: the updates at a level that mean is taken over."""
    prompt_style: str = "direct"
    """With --model: the system prompt (reasoning-gym's ``SYSTEM_PROMPTS[prompt_style]``, which
    asks for ``<answer>...</answer>``) unless --system-prompt is given."""
    teacher_accuracy: float = 0.3
    hidden_size: int = 64
    num_layers: int = 2
    vocab_size: int = 256
    sft_steps: int = 300
    sft_batch: int = 32
    sft_learning_rate: float = 3e-3
    names: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """The tasks (from --task; not a flag)."""


def task_names(task: str, flag: str = "--task") -> tuple[str, ...] | None:
    """The reasoning-gym task names of a ``flag`` value ``reasoning_gym:a,b`` (``--task``, or the
    agent's ``--env``; checked against reasoning-gym's registry), or None for another task."""
    if not task.startswith(PREFIX):
        return None
    names = tuple(n.strip() for n in task[len(PREFIX) :].split(",") if n.strip())
    if not names:
        raise ValueError(f"{flag} {task!r}: name at least one reasoning-gym task after {PREFIX!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} {task!r}: a task is named twice")
    registry = set(datasets()) - {"composite"}  # a mixture is named by its tasks
    for name in names:
        if name not in registry:
            close = difflib.get_close_matches(name, sorted(registry), n=5, cutoff=0.5)
            hint = (
                f"close names: {', '.join(close)}" if close else f"{len(registry)} are registered"
            )
            raise ValueError(f"{flag} {task!r}: {name!r} is not a reasoning-gym task ({hint})")
    return names


def datasets() -> dict[str, tuple[type, type]]:
    """reasoning-gym's registry ``{name: (dataset class, config class)}`` (imports it)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(
            "--task reasoning_gym:... needs reasoning-gym: pip install -e '.[tasks]'"
        ) from e
    return DATASETS


def with_names(task: ReasoningGymTask, names: tuple[str, ...]) -> ReasoningGymTask:
    """``task`` for the tasks ``names``, its weights, options and level checked against them."""
    task = dataclasses.replace(task, names=names)
    if task.weights and len(task.weights) != len(names):
        raise ValueError(
            f"{len(task.weights)} --reasoning-gym.weights for {len(names)} tasks ({', '.join(names)})"
        )
    if any(w <= 0 for w in task.weights):
        raise ValueError(f"--reasoning-gym.weights must be > 0, got {task.weights}")
    if task.size < 1 or task.eval_size < 0:
        raise ValueError(
            "--reasoning-gym.size >= 1 and --reasoning-gym.eval-size >= 0 are required"
        )
    if task.max_level is not None and task.max_level < (task.level or 0):
        raise ValueError(
            f"--reasoning-gym.max-level {task.max_level} is below the first level {task.level or 0}"
        )
    if task.level_window < 1:
        raise ValueError(f"--reasoning-gym.level-window must be >= 1, got {task.level_window}")
    n = len(levels(task))
    train_end, eval_end = (
        task.seed + n * (task.size + len(names)),
        task.eval_seed + n * (task.eval_size + len(names)),
    )
    if task.eval_size and task.seed < eval_end and task.eval_seed < train_end:
        raise ValueError(
            f"--reasoning-gym.eval-seed {task.eval_seed}: reasoning-gym seeds row i by seed + i, so "
            f"held-out seeds [{task.eval_seed}, {eval_end}) meet the training seeds "
            f"[{task.seed}, {train_end}); choose an eval seed >= {train_end}"
        )
    if not 0.0 <= task.teacher_accuracy <= 1.0:
        raise ValueError(
            f"--reasoning-gym.teacher-accuracy {task.teacher_accuracy} is not in [0, 1]"
        )
    system_prompt(task)  # a prompt style reasoning-gym has
    generator_options(task)  # unknown tasks or fields: an error now, not at generation
    return task


def levels(task: ReasoningGymTask) -> tuple[int | None, ...]:
    """The levels the rows are generated at: ``level`` .. ``max_level``, or ``(level,)``."""
    if task.max_level is None:
        return (task.level,)
    return tuple(range(task.level or 0, task.max_level + 1))


def parse_value(text: str) -> Any:
    """A flag's value: JSON (numbers, booleans, lists), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def generator_options(task: ReasoningGymTask) -> dict[str, dict[str, Any]]:
    """Each task's generator fields: its curriculum's at ``level``, then ``options`` on top."""
    registry = datasets()
    out = {name: curriculum_options(name, task.level) for name in task.names}
    for item in task.options:
        key, sep, value = item.partition("=")
        name, dot, field = key.rpartition(".")
        if not sep or not field:
            raise ValueError(f"--reasoning-gym.options {item!r}: expected name.field=value")
        if not dot:
            if len(task.names) != 1:
                raise ValueError(
                    f"--reasoning-gym.options {item!r}: name the task (one of {', '.join(task.names)})"
                )
            name = task.names[0]
        if name not in out:
            raise ValueError(
                f"--reasoning-gym.options {item!r}: {name!r} is not among {task.names}"
            )
        fields = {f.name for f in dataclasses.fields(registry[name][1])} - {"seed", "size"}
        if field not in fields:
            close = difflib.get_close_matches(field, sorted(fields), n=3, cutoff=0.5)
            raise ValueError(
                f"--reasoning-gym.options {item!r}: {name} has no generator field {field!r} "
                f"({'close: ' + ', '.join(close) if close else 'fields: ' + ', '.join(sorted(fields))};"
                " seed and size are --reasoning-gym.seed / .size)"
            )
        out[name][field] = parse_value(value)
    for name, fields in out.items():
        check_generator(name, registry[name][1], fields)
    return out


def check_generator(name: str, config_cls: type, fields: dict[str, Any]) -> None:
    """``ValueError`` naming the task and its options when reasoning-gym's own check of its
    generator config (``validate``) refuses them."""
    try:
        config = config_cls(**fields)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym {name} refuses the generator options {fields}: {e}") from e


def curriculum_options(name: str, level: int | None) -> dict[str, Any]:
    """The generator fields of ``name``'s reasoning-gym curriculum with every attribute at
    ``level`` (capped at its last level); {} for ``level`` None."""
    if level is None:
        return {}
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition
    from reasoning_gym.factory import create_curriculum, has_curriculum

    if not has_curriculum(name):
        raise ValueError(f"--reasoning-gym.level {level}: {name} has no reasoning-gym curriculum")
    curriculum = create_curriculum(name)
    for attr in curriculum.attributes.values():
        curriculum.set_attr_level(attr.name, min(max(level, 0), len(attr.levels) - 1))
    config = curriculum.generate_configuration({})
    fields = []
    for attr in curriculum.attributes.values():
        if isinstance(attr, RangeAttributeDefinition):
            fields += [attr.lower_field_name, attr.upper_field_name]
        else:
            fields.append(attr.field_name)
    return {f: getattr(config, f) for f in fields}


def generate(task: ReasoningGymTask, *, seed: int, size: int) -> list[dict]:
    """reasoning-gym's entries: ``create_dataset`` for one task, a ``CompositeDataset`` (weights
    per task) for a mixture."""
    options = generator_options(task)
    if len(task.names) == 1:
        import reasoning_gym

        name = task.names[0]
        return list(reasoning_gym.create_dataset(name, seed=seed, size=size, **options[name]))
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    weights = task.weights or (1.0,) * len(task.names)
    specs = [DatasetSpec(n, float(w), options[n]) for n, w in zip(task.names, weights)]
    return list(CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs)))


def record(entry: dict) -> dict:
    """A row of an entry: its question as the prompt, its answer, its task as ``data_source`` and
    the entry itself as ``entry`` (``to_json``: tuples and sets kept, so that the scorer reads back
    the very entry it would score in reasoning-gym)."""
    name = entry["metadata"]["source_dataset"]
    try:
        stored = to_json(entry)
    except TypeError as e:
        index = entry["metadata"].get("source_index")
        raise ValueError(f"reasoning-gym {name} row {index}: the entry is not JSON ({e})") from e
    return {
        "prompt": entry["question"],
        "answer": entry["answer"],
        "data_source": name,
        ENTRY_FIELD: stored,
    }


def make_splits(task: ReasoningGymTask) -> tuple[list[dict], list[dict]]:
    """Training rows (``seed``, ``size``) and held-out rows (``eval_seed``, ``eval_size``) whose
    questions are not training questions (the dropped ones counted in a warning); with
    ``max_level``, both at every level (module docstring)."""
    train, held_out = [], []
    for i, level in enumerate(levels(task)):
        at = dataclasses.replace(task, level=level, max_level=None)
        train += leveled(
            generate(at, seed=task.seed + i * (task.size + len(task.names)), size=task.size),
            task,
            level,
        )
        if task.eval_size:  # reasoning-gym refuses a dataset of size 0
            seed = task.eval_seed + i * (task.eval_size + len(task.names))
            held_out += leveled(generate(at, seed=seed, size=task.eval_size), task, level)
    seen = {r["prompt"] for r in train}
    kept = [r for r in held_out if r["prompt"] not in seen]
    if len(kept) < len(held_out):
        warnings.warn(
            f"reasoning_gym:{','.join(task.names)}: {len(held_out) - len(kept)} of "
            f"{len(held_out)} held-out rows repeat a training question and are dropped",
            stacklevel=2,
        )
    return train, kept


def leveled(entries: list[dict], task: ReasoningGymTask, level: int | None) -> list[dict]:
    """The rows of ``entries`` (``record``); on a curriculum each with its ``level`` and the
    level in its ``data_source``."""
    rows = [record(e) for e in entries]
    if task.max_level is None:
        return rows
    return [{**r, "data_source": f"{r['data_source']}/level{level}", "level": level} for r in rows]


def system_prompt(task: ReasoningGymTask) -> str:
    """reasoning-gym's system prompt ``prompt_style`` (it asks for ``<answer>...</answer>``)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if task.prompt_style not in SYSTEM_PROMPTS:
        raise ValueError(
            f"--reasoning-gym.prompt-style {task.prompt_style!r}: one of {', '.join(SYSTEM_PROMPTS)}"
        )
    return SYSTEM_PROMPTS[task.prompt_style]


def target(answer: str) -> str:
    return f"{ANSWER_TAGS[0]}{answer}{ANSWER_TAGS[1]}"


def build_tokenizer(task: ReasoningGymTask, directory: Path) -> TextTokenizer:
    """A sentencepiece BPE tokenizer trained on the rows' prompts and tagged answers (the tags
    are single pieces)."""
    train, held_out = make_splits(task)
    texts = [f"{r['prompt']} {target(r['answer'])}" for r in train + held_out]
    path = train_sentencepiece(
        texts, directory / "tokenizer", vocab_size=task.vocab_size, user_defined_symbols=ANSWER_TAGS
    )
    return load_tokenizer(path)


def teacher(task: ReasoningGymTask, train: list[dict]):
    """The noisy teacher: ``<answer>right</answer>`` with probability ``teacher_accuracy``, else
    the answer of a random training row of the same task (in the same format)."""
    answers: dict[str, list[str]] = {}
    for r in train:
        if r["answer"] is None:
            raise ValueError(
                f"reasoning-gym {r['data_source']} has no single answer per question for the "
                "built-in task's teacher to imitate: train it with --model"
            )
        answers.setdefault(r["data_source"], []).append(r["answer"])

    def targets(records: list[dict], rng: np.random.Generator) -> list[str]:
        out = []
        for r in records:
            pool = answers[r["data_source"]]
            right = rng.random() < task.teacher_accuracy
            out.append(target(r["answer"] if right else pool[int(rng.integers(len(pool)))]))
        return out

    return targets


def train_base_model(
    task: ReasoningGymTask,
    tokenizer: TextTokenizer,
    train: list[dict],
    *,
    key: jax.Array,
    log=print,
) -> Transformer:
    """The short supervised phase on the noisy teacher's tagged answers."""
    config = tiny_llama(
        tokenizer, hidden_size=task.hidden_size, num_layers=task.num_layers, max_positions=256
    )
    return supervised_phase(
        config,
        tokenizer,
        train,
        teacher(task, train),
        steps=task.sft_steps,
        batch=task.sft_batch,
        learning_rate=task.sft_learning_rate,
        seed=task.seed,
        key=key,
        log=log,
    )
