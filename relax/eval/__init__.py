"""Evaluation: held-out sampling and scoring (``evaluate``), unbiased pass@k (``passk``), and
standard benchmarks scored as lm-evaluation-harness scores them (``harness``, ``relax eval``)."""

from relax.eval.evaluate import EvalConfig, evaluate
from relax.eval.harness import TASKS as BENCHMARKS
from relax.eval.harness import HarnessConfig
from relax.eval.harness import run as run_benchmark
from relax.eval.passk import pass_at_k, summarize

__all__ = [
    "BENCHMARKS",
    "EvalConfig",
    "HarnessConfig",
    "evaluate",
    "pass_at_k",
    "run_benchmark",
    "summarize",
]
