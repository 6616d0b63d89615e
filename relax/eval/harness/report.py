"""The evaluation report: one record per item, metrics per filter as lm-eval reports them, a table.

Metric keys follow lm-eval's results (``"exact_match,strict-match"`` and its
``"exact_match_stderr,strict-match"``); with more than one sample per item (pass@k), the verdict
of an item under a filter is the fraction of its samples that pass and ``pass@k`` is the unbiased
estimator (``relax.eval.passk.pass_at_k``) averaged over items. Items whose rows carry a source
(``source``) are also aggregated per source, under ``by_source[source]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from relax.eval.harness.metrics import mean, mean_stderr
from relax.eval.passk import pass_at_k


@dataclasses.dataclass(frozen=True)
class ItemRecord:
    """One evaluated item: its prompt's SHA-256, its completions (after the stop strings) and,
    per filter, the extracted answer and verdict (1.0 / 0.0) of each completion."""

    doc_id: int
    id: str
    source: str | None
    prompt_sha256: str
    target: str
    completions: tuple[str, ...]
    extracted: dict[str, tuple[str, ...]]
    verdicts: dict[str, tuple[float, ...]]


def prompt_hash(prompt: str) -> str:
    """The hex SHA-256 of the prompt's UTF-8 bytes."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def aggregate(records: Sequence[ItemRecord], metric: str, ks: Sequence[int] = ()) -> dict:
    """``{"<metric>,<filter>": mean, "<metric>_stderr,<filter>": stderr, "pass@k,<filter>": ...}``
    over ``records``: an item's score is the mean of its samples' verdicts (its only verdict when
    greedy); mean and stderr as lm-eval's ``mean`` / ``mean_stderr``; ``pass@k`` for each k of
    ``ks`` (<= the samples per item) with the unbiased estimator."""
    out: dict[str, float] = {}
    if not records:
        return out
    for name in records[0].verdicts:
        scores = [mean(r.verdicts[name]) for r in records]
        out[f"{metric},{name}"] = mean(scores)
        out[f"{metric}_stderr,{name}"] = mean_stderr(scores)
        for k in ks:
            n = np.array([len(r.verdicts[name]) for r in records])
            c = np.array([int(sum(v >= 1.0 for v in r.verdicts[name])) for r in records])
            out[f"pass@{k},{name}"] = float(np.mean(pass_at_k(n, c, k)))
    return out


def build_report(
    task: str, records: Sequence[ItemRecord], metric: str, *, ks: Sequence[int] = (), meta: dict
) -> dict:
    """The JSON report: ``task``, ``meta`` (model, settings, timings), ``results`` (``aggregate``
    over every item), ``by_source`` (the same per source, in order of first appearance, when
    items carry one) and ``samples`` (the records)."""
    sources = [r.source for r in records if r.source is not None]
    by_source = {
        s: aggregate([r for r in records if r.source == s], metric, ks)
        for s in dict.fromkeys(sources)
    }
    return {
        "task": task,
        "meta": meta,
        "num_items": len(records),
        "results": aggregate(records, metric, ks),
        "by_source": by_source,
        "samples": [dataclasses.asdict(r) for r in records],
    }


def table(report: dict) -> str:
    """lm-eval's results table: one line per metric and filter (value ± stderr), then one per
    source."""
    rows = [("task", "filter", "metric", "n", "value", "stderr")]

    def add(name: str, results: dict, n: int):
        for key, value in results.items():
            metric, flt = key.split(",", 1)
            if metric.endswith("_stderr"):
                continue
            err = results.get(f"{metric}_stderr,{flt}")
            rows.append(
                (name, flt, metric, str(n), f"{value:.4f}", "" if err is None else f"{err:.4f}")
            )

    add(report["task"], report["results"], report["num_items"])
    for source, results in report["by_source"].items():
        n = sum(1 for s in report["samples"] if s["source"] == source)
        add(f"{report['task']}/{source}", results, n)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_report(report: dict, path: str | Path) -> Path:
    """Write ``report`` as indented JSON (NaN written as null); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    return path


def _finite(x):
    """``x`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x
