"""Tools as JSON schemas, and tool calls parsed from a model's output.

    calc = Tool("multiply", "Multiply two integers.", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}, lambda a, b: a * b)
    tokenizer.apply_chat_template(messages, tools=[calc.schema()], add_generation_prompt=True)
    calls, errors = parse_tool_calls(completion_text, "hermes")

Formats (``TOOL_CALL_FORMATS``), as the major chat templates ask the model to write calls:

- ``hermes`` (Hermes, Qwen 2.5 / 3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  any number of calls per message, text around them allowed;
- ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): the whole message (after an optional
  ``<|python_tag|>``) is one JSON object ``{"name": ..., "parameters": {...}}`` (``"arguments"`` too),
  or several separated by ``;``.

A call that is not valid JSON, lacks a name, names no tool, or whose arguments do not match the
tool's schema (missing required keys, unknown keys, wrong JSON types) is not raised: it comes
back as an error string for the environment to return to the model as an observation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax.choices import check_choice
from relax.models.hf.bounded_json import loads  # bounded depth: one sample cannot crash a rollout

TOOL_CALL_FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call: ``name``, ``description``, its arguments as a JSON schema
    (``parameters``, an object schema) and ``fn(**arguments)`` whose result (``str()``-ed) is the
    observation."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"tool name must be a non-empty string, got {self.name!r}")
        if self.parameters.get("type") != "object":
            raise ValueError(
                f"tool {self.name!r}: parameters must be an object schema, got {self.parameters!r}"
            )

    def schema(self) -> dict:
        """The tool as chat templates take it (``tools=``): OpenAI's function format."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def message(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (for re-rendering a conversation)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(
    text: str, fmt: str, tools: Sequence[Tool] = ()
) -> tuple[list[ToolCall], list[str]]:
    """``(calls, errors)`` in ``text`` written in format ``fmt``; with ``tools``, each call is also
    checked against its tool's schema (an unknown name or bad arguments is an error, not a call)."""
    check_choice("tool call format", fmt, TOOL_CALL_FORMATS)
    bodies = _hermes_bodies(text) if fmt == "hermes" else _llama3_bodies(text)
    calls, errors = [], []
    by_name = {t.name: t for t in tools}
    for body in bodies:
        call = _call(body)
        if isinstance(call, str):
            errors.append(call)
        elif by_name and call.name not in by_name:
            errors.append(f"unknown tool {call.name!r}; tools: {', '.join(sorted(by_name))}")
        elif by_name and (bad := check_arguments(by_name[call.name], call.arguments)):
            errors.append(bad)
        else:
            calls.append(call)
    return calls, errors


def _hermes_bodies(text: str) -> list[str]:
    return [m.group(1).strip() for m in _HERMES.finditer(text)]


def _llama3_bodies(text: str) -> list[str]:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith("{"):
        return []  # a plain answer, not a call
    try:
        loads(text)
        return [text]
    except json.JSONDecodeError:
        return [part.strip() for part in text.split(";") if part.strip()]


def _call(body: str) -> ToolCall | str:
    """The call in one JSON body, or why it is not one."""
    try:
        obj = loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body[:200]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"tool call needs a string 'name': {body[:200]}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some templates and models write the arguments as a JSON string
        try:
            args = loads(args)
        except json.JSONDecodeError:
            return f"arguments of {obj['name']!r} are not a JSON object: {args[:200]}"
    if not isinstance(args, dict):
        return f"arguments of {obj['name']!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(obj["name"], args)


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema (required and unknown keys, JSON types of the
    top-level properties), or None."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", ()) if k not in arguments]
    if missing:
        return f"{tool.name}: missing argument(s) {', '.join(missing)}"
    unknown = [k for k in arguments if k not in props]
    if unknown and tool.parameters.get("additionalProperties", False) is False:
        return (
            f"{tool.name}: unknown argument(s) {', '.join(unknown)}; arguments: {', '.join(props)}"
        )
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        types = _JSON_TYPES.get(kind, (object,)) if isinstance(kind, str) else (object,)
        if not isinstance(value, types) or (
            kind in ("integer", "number") and isinstance(value, bool)
        ):
            return f"{tool.name}: argument {key!r} must be {kind}, got {json.dumps(value)[:60]}"
    return None


def run_call(tool: Tool, call: ToolCall) -> str:
    """``str(tool.fn(**arguments))``, or the error it raised as text (the model reads it)."""
    try:
        return str(tool.fn(**call.arguments))
    except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation
        return f"error: {call.name} raised {type(exc).__name__}: {str(exc)[:200]}"
