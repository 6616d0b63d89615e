"""Benchmark tasks as lm-evaluation-harness 0.4.13 defines them (``lm_eval/tasks/<name>/*.yaml``):
prompt template, few-shot settings, stop strings, answer filters and metric.

    gsm8k      "Question: {question}\\nAnswer:"; target: the whole ``answer`` (reasoning, then
               "#### N"); 5-shot from the train split (default sampler, seed 1234);
               until "Question:", "</s>", "<|im_end|>"; filters strict-match and
               flexible-extract; exact_match (ignore_case; ignoring ",", "$", "(?s).*#### ", a final ".")
    hendrycks_math500
               "Problem: {problem}\nAnswer:", 0-shot, until "Problem:"; target: the solution's
               last \\boxed{} answer; exact_match by ``is_equiv`` on the completion's ``$...$``
               part (``relax.eval.harness.math_answers``); per-subject breakdown
    humaneval  the ``prompt`` as it is, 0-shot, until "\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint",
               max_gen_toks 1024; the program ``prompt + completion``, then ``test`` and
               ``check(entry_point)``, passes when it runs to the end (pass@1; ``relax.eval.harness.code``)

Rows are read from local jsonl / parquet files with the benchmark's own column names (GSM8K:
``question``, ``answer``; HumanEval: ``task_id``, ``prompt``, ``test``, ``entry_point``; MBPP: ``task_id``, ``text``,
``test_list``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from relax.eval.harness.fewshot import PromptLayout
from relax.eval.harness.filters import FilterPipeline, PrefixPrompt, RegexFilter
from relax.eval.harness.math_answers import MathEquiv, math_target
from relax.eval.harness.mbpp_shots import MBPP_FEWSHOT
from relax.eval.harness.metrics import ExactMatch

Doc = dict


@dataclasses.dataclass(frozen=True)
class HarnessTask:
    """One benchmark's lm-eval settings (field names as in lm-eval's task YAML)."""

    name: str
    fields: tuple[str, ...]
    """Columns every row must have (a missing one is an error naming the file and row)."""
    doc_to_text: Callable[[Doc], str]
    doc_to_target: Callable[[Doc], str]
    until: tuple[str, ...]
    filters: tuple[FilterPipeline, ...]
    metric: ExactMatch | MathEquiv | str
    """An ``ExactMatch`` (or MATH's ``MathEquiv``) against ``doc_to_target``, or ``"pass@1"``: the filtered program runs
    with the item's tests (``relax.eval.harness.code``)."""
    num_fewshot: int = 0
    fewshot_sampler: str = "default"
    fewshot_docs: tuple[Doc, ...] | None = None
    """Fixed few-shot examples (lm-eval's ``fewshot_config.samples``; MBPP's three), used instead
    of a few-shot file."""
    fewshot_target: Callable[[Doc], str] | None = None
    """A few-shot example's target, when it is not ``doc_to_target`` (MBPP: its code, then
    "[DONE]")."""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    max_gen_toks: int = 256
    id_field: str | None = None
    """The column that names an item in the report (None or absent: its 0-based index, lm-eval's
    doc_id)."""
    source_field: str = "source"
    """The column that names an item's source, for the per-source breakdown (absent: none)."""

    @property
    def layout(self) -> PromptLayout:
        """How its prompts are written (``relax.eval.harness.fewshot``)."""
        return PromptLayout(
            self.doc_to_text,
            self.fewshot_target or self.doc_to_target,
            self.target_delimiter,
            self.fewshot_delimiter,
        )


GSM8K_STRICT = FilterPipeline("strict-match", (RegexFilter(r"#### (\-?[0-9\.\,]+)"),))
GSM8K_FLEXIBLE = FilterPipeline(
    "flexible-extract", (RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1),)
)
GSM8K_EXACT_MATCH = ExactMatch(
    regexes_to_ignore=(",", "\\$", "(?s).*#### ", "\\.$"), ignore_case=True
)

GSM8K = HarnessTask(
    name="gsm8k",
    fields=("question", "answer"),
    doc_to_text=lambda d: f"Question: {d['question']}\nAnswer:",
    doc_to_target=lambda d: str(d["answer"]),
    until=("Question:", "</s>", "<|im_end|>"),
    filters=(GSM8K_STRICT, GSM8K_FLEXIBLE),
    metric=GSM8K_EXACT_MATCH,
    num_fewshot=5,
)

HUMANEVAL = HarnessTask(
    name="humaneval",
    fields=("task_id", "prompt", "test", "entry_point"),
    doc_to_text=lambda d: str(d["prompt"]),
    doc_to_target=lambda d: f"{d['test']}\ncheck({d['entry_point']})",
    until=("\nclass", "\ndef", "\n#", "\nif", "\nprint"),
    filters=(FilterPipeline("create_test", (PrefixPrompt(),)),),
    metric="pass@1",
    max_gen_toks=1024,
    id_field="task_id",
)

HENDRYCKS_MATH500 = HarnessTask(
    name="hendrycks_math500",
    fields=("problem", "solution"),
    doc_to_text=lambda d: f"Problem: {d['problem']}\nAnswer:",
    doc_to_target=lambda d: math_target(str(d["solution"])),
    until=("Problem:",),
    filters=(FilterPipeline("none", ()),),
    metric=MathEquiv(),
    id_field="unique_id",
    source_field="subject",
)


def _mbpp_text(d: Doc) -> str:
    tests = d["test_list"]
    return (
        f"You are an expert Python programmer, and here is your task: {d['text']} Your code "
        f"should pass these tests:\n\n{tests[0]}\n{tests[1]}\n{tests[2]}\n[BEGIN]\n"
    )


MBPP = HarnessTask(
    name="mbpp",
    fields=("task_id", "text", "test_list"),
    doc_to_text=_mbpp_text,
    doc_to_target=lambda d: "\n".join(d["test_list"][:3]),
    until=("[DONE]",),
    filters=(FilterPipeline("none", ()),),
    metric="pass@1",
    num_fewshot=3,
    fewshot_sampler="first_n",
    fewshot_docs=MBPP_FEWSHOT,
    fewshot_target=lambda d: f"{d['code']}\n[DONE]",
    target_delimiter="",
    id_field="task_id",
)

TASKS: dict[str, HarnessTask] = {t.name: t for t in (GSM8K, HENDRYCKS_MATH500, HUMANEVAL, MBPP)}
"""The benchmarks ``relax eval --task`` knows, by lm-eval's task name."""


def get_task(name: str) -> HarnessTask:
    """The task called ``name`` (an error lists the known ones)."""
    if name not in TASKS:
        raise ValueError(f"unknown benchmark {name!r}; relax eval knows {sorted(TASKS)}")
    return TASKS[name]
