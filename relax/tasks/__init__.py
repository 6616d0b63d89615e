"""Built-in verifiable tasks that run offline: ``reverse`` (the default of every example), ``code``
(write a function, checked by tests in the sandbox), ``math`` (LaTeX answers, math-verify) and
``visual`` (count the shapes in a picture: a vision-language model, GRPO only).

Each text task module has ``make_splits(task) -> (train, held_out)`` records,
``build_tokenizer(task, directory)`` and ``train_base_model(task, tokenizer, train, key=, log=)``;
``TASKS`` maps names to them. The visual task's rows and base model (a tiny Qwen2.5-VL directory)
are ``relax.tasks.visual_base.prepare_visual``'s.
"""

from relax.tasks import code, math, reverse

TASKS = {"reverse": reverse, "code": code, "math": math}
# What GRPO / PPO score each task with, and how long its completions are.
TASK_REWARDS = {
    "reverse": ("exact_match",),
    "code": ("code_exec",),
    "math": ("math_verify",),
    "visual": ("exact_match",),
}
TASK_MAX_NEW_TOKENS = {"reverse": 8, "code": 32, "math": 16, "visual": 4}
TASK_PROMPT_TOKENS = {"reverse": 16, "code": 32, "math": 32, "visual": 64}
# exact_match costs microseconds (a pool would only add start-up time); code runs in the sandbox
TASK_REWARD_WORKERS = {"reverse": 0, "code": 2, "math": 2, "visual": 0}
