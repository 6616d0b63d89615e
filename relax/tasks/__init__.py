"""Built-in verifiable tasks that run offline: ``reverse`` (the default of every example), ``code``
(write a function, checked by tests in the sandbox), ``math`` (LaTeX answers, math-verify) and
``visual`` (count the shapes in a picture: a vision-language model, GRPO only), and
``reasoning_gym:<name>[,<name>...]`` (reasoning-gym's generated rows, scored by its own scorers).

Each text task module has ``make_splits(task) -> (train, held_out)`` records,
``build_tokenizer(task, directory)`` and ``train_base_model(task, tokenizer, train, key=, log=)``;
``TASKS`` maps names to them (``kind(task)``: a table's key for ``--task``). The visual task's
rows and base model (a tiny Qwen2.5-VL directory) are ``relax.tasks.visual_base.prepare_visual``'s.
"""

from relax.tasks import code, math, reasoning_gym, reverse


def kind(task: str) -> str:
    """The tables' key of ``--task``: ``reasoning_gym`` for every ``reasoning_gym:<names>``, else
    the task's own name."""
    return "reasoning_gym" if task.startswith(reasoning_gym.PREFIX) else task


TASKS = {"reverse": reverse, "code": code, "math": math, "reasoning_gym": reasoning_gym}
# What GRPO / PPO score each task with, and how long its completions are.
TASK_REWARDS = {
    "reverse": ("exact_match",),
    "code": ("code_exec",),
    "math": ("math_verify",),
    "visual": ("exact_match",),
    "reasoning_gym": ("reasoning_gym",),
}
TASK_MAX_NEW_TOKENS = {"reverse": 8, "code": 32, "math": 16, "visual": 4, "reasoning_gym": 16}
TASK_PROMPT_TOKENS = {"reverse": 16, "code": 32, "math": 32, "visual": 64, "reasoning_gym": 64}
# exact_match and reasoning-gym's scorers cost microseconds (a pool would only add start-up
# time); code runs in the sandbox
TASK_REWARD_WORKERS = {"reverse": 0, "code": 2, "math": 2, "visual": 0, "reasoning_gym": 0}
