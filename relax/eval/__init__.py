"""Evaluation: held-out sampling and scoring (``evaluate``), unbiased pass@k (``passk``)."""

from relax.eval.evaluate import EvalConfig, evaluate
from relax.eval.passk import pass_at_k, summarize

__all__ = ["EvalConfig", "evaluate", "pass_at_k", "summarize"]
