"""Command lines and run configuration: flags, nested configs, the start-up report."""

from relax.algorithms.cli.configure import FLAT, LOSS_OPTION_NAMES, flat_fields
from relax.algorithms.cli.flags import (
    RENAMED_LOSS_FLAGS,
    Config,
    cli,
    defaults_note,
    flag_value,
    flag_values,
    loss_flags,
    parse_flags,
    uses_model,
)
from relax.algorithms.cli.report import (
    FIRST_PROMPT_CHARS,
    StartupReport,
    config_lines,
    first_prompt_lines,
    first_row_lines,
    model_lines,
    prompt_lines,
    run_report,
    token_lines,
)

__all__ = [
    "Config",
    "FIRST_PROMPT_CHARS",
    "FLAT",
    "LOSS_OPTION_NAMES",
    "RENAMED_LOSS_FLAGS",
    "StartupReport",
    "cli",
    "config_lines",
    "defaults_note",
    "first_prompt_lines",
    "first_row_lines",
    "flag_value",
    "flag_values",
    "flat_fields",
    "loss_flags",
    "model_lines",
    "parse_flags",
    "prompt_lines",
    "run_report",
    "token_lines",
    "uses_model",
]
