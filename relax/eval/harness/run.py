"""``relax eval``: a checkpoint on a benchmark's local files, as lm-evaluation-harness scores it.

``evaluate_items`` is the whole evaluation after loading (prompts, generation, filters, metric,
report); ``run`` adds the loading, the printed table and the JSON file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from relax.eval.harness.fewshot import build_context, chat_messages, sample_fewshot
from relax.eval.harness.filters import apply_all
from relax.eval.harness.report import ItemRecord, build_report, prompt_hash, table, write_report
from relax.eval.harness.tasks import HarnessTask, get_task

if TYPE_CHECKING:
    from relax.eval.harness.load import Policy


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """``relax eval`` flags."""

    task: str = "gsm8k"
    """The benchmark, by lm-eval's task name: gsm8k, hendrycks_math500, humaneval, mbpp."""
    data: str = ""
    """The items to evaluate: a jsonl / parquet file (or a directory / glob of them) with the
    benchmark's own columns (GSM8K's test split: question, answer)."""
    fewshot_data: str | None = None
    """The rows few-shot examples are drawn from (GSM8K: its train split). None: ``data`` itself
    (each item then never its own example, as lm-eval does when the splits are the same)."""
    model: str | None = None
    """A Hugging Face model directory (the base, with --adapter)."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory, applied to --model."""
    run_dir: str | None = None
    """A relax run directory: its final_hf export, else its newest export (hf/step-N) or
    checkpoint (checkpoints/N), whichever is later."""
    step: int | None = None
    """With --run-dir: the run's checkpoint of this step (its policy on the run's base model),
    else its export hf/step-N."""
    limit: int | None = None
    """Evaluate the first N items only (lm-eval's --limit)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: the task's, GSM8K 5)."""
    fewshot_seed: int = 1234
    """The seed of the few-shot draws (lm-eval's --seed's fewshot part, default 1234)."""
    apply_chat_template: bool = False
    """Render each prompt with the model's chat template (lm-eval's --apply_chat_template),
    with a generation prompt: for instruct models."""
    fewshot_as_multiturn: bool = True
    """With --apply-chat-template: each few-shot example a user and an assistant turn (lm-eval's
    default with a chat template); --no-fewshot-as-multiturn: the plain prompt as one user turn."""
    system_instruction: str | None = None
    """A system instruction (lm-eval's --system_instruction): a system message with
    --apply-chat-template, else the prompt's first text, as lm-eval puts it."""
    max_gen_toks: int | None = None
    """Completion budget in tokens (None: the task's, lm-eval's default 256; HumanEval 1024)."""
    batch_size: int = 16
    """Prompts per sampler call."""
    num_samples: int = 1
    """Completions per item: 1 greedy (temperature 0), or n for pass@k at --temperature."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy). More than one sample needs temperature > 0."""
    ks: tuple[int, ...] = ()
    """pass@k for these k (each <= --num-samples); empty: none beyond the metric's mean."""
    seed: int = 0
    """PRNG seed of the sampler (used when temperature > 0)."""
    source_field: str | None = None
    """A column naming each item's source, for the per-source breakdown (ignored when absent;
    None: the task's, ``source``, or MATH-500's ``subject``)."""
    output: str | None = None
    """Write the JSON report here (None: print only the table)."""

    def __post_init__(self):
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.step is not None and self.run_dir is None:
            raise ValueError("--step goes with --run-dir (a step of that run)")
        if self.num_samples > 1 and self.temperature <= 0:
            raise ValueError("--num-samples > 1 needs --temperature > 0 (greedy samples are equal)")
        if any(k < 1 or k > self.num_samples for k in self.ks):
            raise ValueError(
                f"--ks must be in [1, --num-samples={self.num_samples}], got {self.ks}"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError(
                "--no-fewshot-as-multiturn is a chat layout: add --apply-chat-template"
            )


def load_docs(path: str, fields: Sequence[str], limit: int | None = None) -> list[dict]:
    """The rows of ``path`` (jsonl / parquet) as dicts, the first ``limit``; a row without one of
    ``fields`` raises an error naming the file, row and field."""
    from relax.data.files import read_records

    rows = [r.record for r in read_records(path, fields=tuple(fields))]
    return rows if limit is None else rows[:limit]


def build_prompts(
    task: HarnessTask,
    docs: Sequence[dict],
    pool: Sequence[dict],
    *,
    num_fewshot: int,
    seed: int,
    same_split: bool,
    system: str = "",
    render: Callable[[list[dict]], str] | None = None,
    multiturn: bool = True,
) -> list[str]:
    """Each item's prompt: ``num_fewshot`` examples drawn from ``pool`` as lm-eval draws them;
    with ``render`` (a chat template with a generation prompt) its chat messages rendered
    (``chat_messages``), else the plain text with ``system`` first."""
    shots = sample_fewshot(
        docs, pool, num_fewshot, seed=seed, sampler=task.fewshot_sampler, same_split=same_split
    )
    if render is None:
        return [build_context(doc, ex, task.layout, system) for doc, ex in zip(docs, shots)]
    return [
        render(chat_messages(doc, ex, task.layout, system=system, multiturn=multiturn))
        for doc, ex in zip(docs, shots)
    ]


def chat_renderer(tokenizer) -> Callable[[list[dict]], str]:
    """Messages -> the model's chat template's text with a generation prompt (lm-eval's ``hf``
    model's ``apply_chat_template``); an error naming the model when it has none."""
    if not tokenizer.has_chat_template:
        raise ValueError(f"--apply-chat-template: {tokenizer.path} has no chat template")
    return lambda messages: tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def score_items(
    task: HarnessTask,
    docs: Sequence[dict],
    prompts: Sequence[str],
    completions: Sequence[Sequence[str]],
    *,
    source_field: str | None = None,
    run_code: Callable | None = None,
) -> list[ItemRecord]:
    """Filter each completion with every pipeline of ``task`` and score it: ``exact_match``
    against the target, or (``"pass@1"``) ``run_code(programs, doc) -> verdicts`` on the
    filtered programs (``relax.eval.harness.code.run_programs``)."""
    src = task.source_field if source_field is None else source_field
    records = []
    for i, (doc, prompt, comps) in enumerate(zip(docs, prompts, completions)):
        target = task.doc_to_target(doc)
        per = [apply_all(task.filters, c, task.doc_to_text(doc)) for c in comps]
        extracted = {f.name: tuple(p[f.name] for p in per) for f in task.filters}
        if isinstance(task.metric, str):
            if run_code is None:
                from relax.eval.harness.code import run_programs as run_code
            verdicts = {
                n: tuple(run_code([f"{a}\n{target}" for a in v], doc)) for n, v in extracted.items()
            }
        else:
            verdicts = {n: tuple(task.metric(a, target) for a in v) for n, v in extracted.items()}
        records.append(
            ItemRecord(
                doc_id=i,
                id=str(doc.get(task.id_field, i)) if task.id_field else str(i),
                source=None if doc.get(src) is None else str(doc[src]),
                prompt_sha256=prompt_hash(prompt),
                target=target,
                completions=tuple(comps),
                extracted=extracted,
                verdicts=verdicts,
            )
        )
    return records


def load_hf(cfg: HarnessConfig) -> Policy:
    """``--model`` (+ ``--adapter``) or ``--run-dir``'s Hugging Face export."""
    from relax.eval.harness.load import load_policy

    if cfg.step is not None:
        raise ValueError("--step reads a run's checkpoint: relax.train.run_policy.load_run_policy")
    return load_policy(cfg.model, cfg.adapter, cfg.run_dir)


def metric_name(task: HarnessTask) -> str:
    """The metric's name in the report (lm-eval's)."""
    return task.metric if isinstance(task.metric, str) else task.metric.name


def run(
    cfg: HarnessConfig,
    log: Callable[[str], None] = print,
    load: Callable[[HarnessConfig], Policy] | None = None,
) -> dict:
    """Load, prompt, generate, score, print the table, write ``cfg.output``; returns the report.

    ``load``: the checkpoint of ``cfg`` (``relax eval`` passes ``relax.train.run_policy``'s,
    which reads a run's checkpoints too); None: ``load_policy``, Hugging Face directories only."""
    import jax

    from relax.eval.harness.generate import generate_texts

    task = get_task(cfg.task)
    if not cfg.data:
        raise ValueError("--data is required: the benchmark's local file (jsonl or parquet)")
    docs = load_docs(cfg.data, task.fields, cfg.limit)
    num_fewshot = task.num_fewshot if cfg.num_fewshot is None else cfg.num_fewshot
    same = cfg.fewshot_data is None and task.fewshot_docs is None
    if task.fewshot_docs is not None:
        if cfg.fewshot_data is not None:
            raise ValueError(
                f"{task.name} draws its examples from lm-eval's fixed ones; drop --fewshot-data"
            )
        pool = list(task.fewshot_docs)
    elif num_fewshot:
        pool = load_docs(cfg.data if same else cfg.fewshot_data, task.fields)
    else:
        pool = []
    t0 = time.perf_counter()
    policy = (load or load_hf)(cfg)
    t1 = time.perf_counter()
    prompts = build_prompts(
        task,
        docs,
        pool,
        num_fewshot=num_fewshot,
        seed=cfg.fewshot_seed,
        same_split=same,
        system=cfg.system_instruction or "",
        render=chat_renderer(policy.tokenizer) if cfg.apply_chat_template else None,
        multiturn=cfg.fewshot_as_multiturn,
    )
    max_gen = task.max_gen_toks if cfg.max_gen_toks is None else cfg.max_gen_toks
    log(f"relax eval: {task.name}, {len(docs)} items, {num_fewshot}-shot, {policy.source}")
    completions = generate_texts(
        policy.model,
        policy.tokenizer,
        prompts,
        until=task.until,
        max_new_tokens=max_gen,
        num_samples=cfg.num_samples,
        temperature=cfg.temperature,
        batch_size=cfg.batch_size,
        key=jax.random.key(cfg.seed),
    )
    t2 = time.perf_counter()
    records = score_items(task, docs, prompts, completions, source_field=cfg.source_field)
    meta = {
        "model": policy.source,
        "num_fewshot": num_fewshot,
        "fewshot_seed": cfg.fewshot_seed,
        "chat_template": cfg.apply_chat_template,
        "fewshot_as_multiturn": cfg.apply_chat_template and cfg.fewshot_as_multiturn,
        "system_instruction": cfg.system_instruction,
        "max_gen_toks": max_gen,
        "num_samples": cfg.num_samples,
        "temperature": cfg.temperature,
        "load_s": round(t1 - t0, 3),
        "generate_s": round(t2 - t1, 3),
        "score_s": round(time.perf_counter() - t2, 3),
        "unextracted": {  # completions a regex filter found no answer in (lm-eval's fallback)
            f.name: sum(r.extracted[f.name].count("[invalid]") for r in records)
            for f in task.filters
        },
    }
    report = build_report(task.name, records, metric_name(task), ks=cfg.ks, meta=meta)
    log(table(report))
    if cfg.output:
        log(f"report: {write_report(report, Path(cfg.output))}")
    return report
