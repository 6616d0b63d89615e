"""Evaluate a checkpoint on a benchmark's local files as lm-evaluation-harness does (``relax eval``).

    relax eval --model HF_DIR --data gsm8k/test.jsonl --fewshot-data gsm8k/train.jsonl
    relax eval --model BASE --adapter ADAPTER_DIR --data ... --limit 200 --output report.json
    relax eval --run-dir runs/qwen-gsm8k --data ...          # the run's final_hf export
    relax eval --run-dir runs/qwen-gsm8k --step 200 --data ...   # its checkpoint of step 200
    relax eval --task hendrycks_math500 --model HF_DIR --data math500.jsonl   # per-subject table
    relax eval --task humaneval --model HF_DIR --data humaneval.jsonl --num-samples 10 \\
        --temperature 0.8 --ks 1 5 10                        # pass@k; programs in the sandbox

Prompts, few-shot draws (seed 1234), stop strings, answer filters and metrics are lm-eval's tasks
of the same name (``relax.eval.harness.tasks``); greedy by default. Prints lm-eval's results
table and writes a JSON report with every item (``--output``). Every field of
``relax.eval.harness.run.HarnessConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from relax.commands.command import Command

NAME = "eval"


def run(argv: list[str]) -> int:
    """Flags -> the evaluation, its table printed; exit status 0."""
    import tyro

    from relax.eval.harness.run import HarnessConfig
    from relax.eval.harness.run import run as run_eval
    from relax.train.run_policy import load_run_policy

    cfg = tyro.cli(HarnessConfig, args=argv, description=__doc__, prog=f"relax {NAME}")
    run_eval(cfg, load=load_run_policy)
    return 0


COMMAND = Command(
    NAME,
    "a checkpoint on local GSM8K, MATH-500, HumanEval, MBPP files, scored as lm-eval does",
    run,
)
