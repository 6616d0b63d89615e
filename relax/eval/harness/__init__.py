"""``relax eval``: checkpoints on standard benchmarks, scored as lm-evaluation-harness scores them.

Modules: ``tasks`` (each benchmark's lm-eval settings), ``fewshot`` (lm-eval's few-shot draws and
prompt text), ``filters`` (answer extraction and stop strings), ``metrics`` (exact_match, mean,
stderr), ``code`` (HumanEval programs in relax's sandbox), ``generate`` (relax's sampler over text
prompts), ``load`` (model, adapter or run), ``report`` (records, aggregation, table, JSON) and
``run`` (the command's config and ``run``). lm_eval itself is never imported.
"""

from relax.eval.harness.fewshot import PromptLayout, build_context, chat_messages, sample_fewshot
from relax.eval.harness.filters import FilterPipeline, RegexFilter, truncate_at_stops
from relax.eval.harness.metrics import ExactMatch, mean, mean_stderr
from relax.eval.harness.report import ItemRecord, aggregate, build_report, table
from relax.eval.harness.run import HarnessConfig, build_prompts, run, score_items
from relax.eval.harness.tasks import TASKS, HarnessTask, get_task

__all__ = [
    "TASKS",
    "ExactMatch",
    "FilterPipeline",
    "HarnessConfig",
    "HarnessTask",
    "ItemRecord",
    "PromptLayout",
    "RegexFilter",
    "aggregate",
    "build_context",
    "build_prompts",
    "build_report",
    "chat_messages",
    "get_task",
    "mean",
    "mean_stderr",
    "run",
    "sample_fewshot",
    "score_items",
    "table",
    "truncate_at_stops",
]
