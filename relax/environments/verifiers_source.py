"""A ``verifiers`` (0.4.0) environment loaded for relax: its tasks as rows, its tools served in
this process, and its rewards scored on a trajectory's messages.

    source = VerifiersSource(parse_spec("verifiers:my_taskset?size=64"))
    rows = source.rows()                         # one dict per task: prompt, answer, vf_task
    task = source.task(rows[0])                  # the verifiers Task again, from the row
    trace = await source.score(task, messages)   # Task.score on a Trace of the messages
    trace.reward, trace.rewards                  # the weighted sum, each reward's score

In verifiers 0.4.0 an environment is a *taskset* (an installed module whose ``__all__`` exports a
``vf.Taskset`` subclass, found by id as ``vf.load_environment`` finds it), the ``vf.Task`` type
it yields (its ``@vf.reward`` methods with their weights, plugged rewards and judges are the
rubric; ``Task.score`` scores a ``vf.Trace``), the ``vf.Toolset`` servers of the taskset and the
task (their ``@vf.tool`` methods), and the ``vf.Env`` that drives an episode
(``SingleAgentEnv`` unless the module exports its own). relax samples every policy turn itself:
verifiers' own generation (an OpenAI client behind a harness) is never used.

Spec: ``verifiers:<taskset id>[?key=value&...]``. A key that is a field of the environment's
config (``EnvConfig`` subclass, e.g. a multi-turn env's own knobs) goes there, every other key to
the taskset's config (``TasksetConfig`` subclass); values are JSON when they parse as JSON, else
strings. ``tool_format`` (relax's, ``hermes`` or ``llama3``) is how the policy writes tool calls.

Tools run in this process through an in-process MCP server, as verifiers' own harness serves
them (``Toolset.register``); a tool is named ``<server>_<tool>`` as verifiers advertises it.
Toolsets are made once per run and shared by every trajectory (``setup()`` runs once; per-task
``setup_task`` is not called).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from relax.choices import check_choice
from relax.environments.tools import TOOL_CALL_FORMATS, Tool

SCHEME = "verifiers:"


def is_verifiers(spec: str | None) -> bool:
    """Whether ``spec`` names a verifiers environment (``verifiers:<id>``)."""
    return spec is not None and spec.startswith(SCHEME)


@dataclasses.dataclass(frozen=True)
class VerifiersSpec:
    """``--env verifiers:<taskset>?args``: the taskset id, its ``key=value`` arguments (taskset or
    env config, split at load) and relax's ``tool_format``."""

    text: str
    taskset: str
    args: Mapping[str, Any]
    tool_format: str = "hermes"


def parse_spec(spec: str) -> VerifiersSpec:
    """``verifiers:<id>[?k=v&...]`` parsed; ``ValueError`` naming the spec when malformed."""
    if not is_verifiers(spec):
        raise ValueError(f"--env {spec!r}: expected verifiers:<taskset id>[?key=value&...]")
    ident, _, query = spec[len(SCHEME) :].partition("?")
    if not ident:
        raise ValueError(f"--env {spec!r}: no taskset id after {SCHEME!r}")
    args: dict[str, Any] = {}
    for part in query.split("&") if query else ():
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"--env {spec!r}: {part!r} is not key=value")
        if key in args:
            raise ValueError(f"--env {spec!r}: {key!r} given twice")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    fmt = str(args.pop("tool_format", "hermes"))
    check_choice("tool_format", fmt, TOOL_CALL_FORMATS)
    return VerifiersSpec(spec, ident, args, fmt)


def run_sync(coro):
    """``coro`` run to completion from synchronous code (in a fresh thread when this thread
    already runs an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def prompt_messages(data) -> list[dict]:
    """A task's opening conversation as chat messages: its system prompt, then its prompt (a
    string is one user message; ``None``: no prompt, the env opens the conversation)."""
    out = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt is not None:
        out += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]
    return out


class ToolBox:
    """The ``@vf.tool`` methods of verifiers toolsets as relax ``Tool``s (for the chat template
    and ``parse_tool_calls``' schema checks), called through an in-process MCP server."""

    def __init__(self, toolsets: Sequence[Any]):
        from mcp.server.mcpserver import MCPServer

        self.toolsets, self._dispatch, tools = list(toolsets), {}, []
        for ts in self.toolsets:
            server = MCPServer(name=ts.server_name or type(ts).__name__)
            ts.register(server)
            for info in run_sync(server.list_tools()):
                full = f"{ts.server_name}_{info.name}" if ts.server_name else info.name
                if full in self._dispatch:
                    raise ValueError(f"verifiers toolsets: two tools named {full!r}")
                self._dispatch[full] = (server, info.name)
                call = functools.partial(self._call_sync, full)
                tools.append(Tool(full, info.description or "", info.input_schema, call))
        self.tools = tuple(tools)
        self._started = False

    async def start(self) -> None:
        """Each toolset's ``setup()``, once."""
        if not self._started:
            self._started = True
            for ts in self.toolsets:
                await ts.setup()

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The tool's result as the tool message's text (``error: ...`` when it failed)."""
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        server, raw = self._dispatch[name]
        try:
            result = await server.call_tool(raw, dict(arguments))
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation
            return f"error: {name} raised {type(exc).__name__}: {str(exc)[:200]}"
        content = mcp_content_to_chat_content(result.content)
        text = content if isinstance(content, str) else json.dumps(content)
        return f"error: {text}" if result.is_error else text

    def _call_sync(self, name: str, **arguments) -> str:
        return run_sync(self.call(name, arguments))


class VerifiersSource:
    """One verifiers environment, loaded once per run (module docstring)."""

    def __init__(self, spec: VerifiersSpec):
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

        self.spec, self._vf = spec, vf
        try:
            env_fields = set(env_config_type(spec.taskset).model_fields) - {"taskset", "id"}
        except ModuleNotFoundError as e:
            raise ValueError(f"--env {spec.text!r}: {e}") from e
        env_args = {k: v for k, v in spec.args.items() if k in env_fields}
        taskset_args = {k: v for k, v in spec.args.items() if k not in env_fields}
        config = resolve_env_config({"taskset": {"id": spec.taskset, **taskset_args}, **env_args})
        self.env = vf.load_environment(config)
        self.single = isinstance(self.env, vf.SingleAgentEnv)
        seats = list(agent_config_fields(config))
        if len(seats) != 1:
            raise ValueError(
                f"--env {spec.text!r}: {type(self.env).__name__} has the agent seats {seats}; "
                "relax plays one seat (the policy): environments with a modeled user or judge "
                "agent are not supported"
            )
        self.seat = seats[0]
        self.taskset = self.env.taskset
        self.task_cls = type(self.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        toolsets = type(self.taskset).toolsets(self.taskset.config)
        toolsets += self.task_cls.toolsets(self.taskset.config.task)
        self.toolbox = ToolBox(toolsets)
        self._weights: dict[str, float] | None = None

    @property
    def tools(self) -> tuple[Tool, ...]:
        return self.toolbox.tools

    def schemas(self) -> list[dict] | None:
        """The tools for the chat template's ``tools=`` (None: the environment has none)."""
        return [t.schema() for t in self.tools] or None

    @property
    def single_turn(self) -> bool:
        """One policy turn per task: the single-agent env with no tools."""
        return self.single and not self.tools

    def rows(self) -> list[dict]:
        """Every task of the taskset as a row: ``prompt`` (a string when the task's prompt is one
        with no system prompt, else chat messages), ``answer`` (the task's, "" if none) and
        ``vf_task`` (the task's data, for ``task``)."""
        if not self.taskset.bounded:
            raise ValueError(
                f"--env {self.spec.text!r}: the taskset is infinite; bound it (e.g. a size argument)"
            )
        return [self.row(task) for task in self.taskset]

    def row(self, task) -> dict:
        data = task.data
        plain = isinstance(data.prompt, str) and data.system_prompt is None
        dumped = data.model_dump(mode="json", exclude_none=True)
        prompt = data.prompt if plain else prompt_messages(data)
        return {"prompt": prompt, "answer": str(dumped.get("answer", "")), "vf_task": dumped}

    def task(self, row: Mapping[str, Any]):
        """The verifiers task a row holds (its ``vf_task`` column)."""
        if "vf_task" not in row:
            raise KeyError(
                f"--env {self.spec.text!r}: a row needs the column 'vf_task' (the task's data, "
                f"as VerifiersSource.rows writes it); got columns {sorted(row)}"
            )
        return self.task_cls(self.data_cls.model_validate(row["vf_task"]), self.taskset.config.task)

    def reward_weights(self) -> dict[str, float]:
        """Each reward's name and weight: the task type's ``@vf.reward`` methods and plugged
        rewards, and its judges (computed once)."""
        if self._weights is None:
            self._weights = self._reward_weights()
        return dict(self._weights)

    def _reward_weights(self) -> dict[str, float]:
        probe = next(iter(self.taskset.take(1)), None)
        if probe is None:
            raise ValueError(f"--env {self.spec.text!r}: the taskset has no task")
        out = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in probe.hooks("reward")}
        out |= {j.reward_name: float(j.config.weight) for j in probe.plugged_judges()}
        if not out:
            raise ValueError(f"--env {self.spec.text!r}: its task type declares no reward")
        return out

    async def score(self, task, messages: Sequence[Mapping[str, Any]]):
        """``task.score`` on a ``vf.Trace`` of ``messages`` (verifiers' message format; the
        assistant messages marked as sampled); returns the trace (``rewards``, ``reward``)."""
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        vf = self._vf
        adapter = TypeAdapter(vf.Message)
        nodes = []
        for i, m in enumerate(messages):
            msg = adapter.validate_python(dict(m))
            sampled = isinstance(msg, vf.AssistantMessage)
            nodes.append(MessageNode(parent=i - 1 if i else None, message=msg, sampled=sampled))
        tools = [
            vf.Tool(name=t.name, description=t.description, parameters=dict(t.parameters))
            for t in self.tools
        ]
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig(), name=self.seat),
            tools=tools,
            nodes=nodes,
            is_completed=True,
            ok=True,
        )
        await task.score(trace)
        return trace


@functools.lru_cache(maxsize=8)
def load_source(spec: str) -> VerifiersSource:
    """The source ``spec`` names, loaded once per process."""
    return VerifiersSource(parse_spec(spec))
