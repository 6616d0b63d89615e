"""Environments for multi-turn rollouts: the protocol (``reset`` / ``step``, sync and async), tools
as JSON schemas with tool calls parsed from model output, and ``ToolEnvironment``."""

from relax.environments.protocol import (
    Action,
    AsyncEnvironment,
    Environment,
    StepResult,
    as_async,
    step_all,
)
from relax.environments.tool_env import ToolEnvironment
from relax.environments.tools import (
    TOOL_CALL_FORMATS,
    Tool,
    ToolCall,
    check_arguments,
    parse_tool_calls,
)

__all__ = [
    "Action",
    "AsyncEnvironment",
    "Environment",
    "StepResult",
    "TOOL_CALL_FORMATS",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "as_async",
    "check_arguments",
    "parse_tool_calls",
    "step_all",
]
