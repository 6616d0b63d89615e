"""``verifiers`` (0.4.0) environments in relax (``relax.environments.verifiers_*``), over three
environments written here as importable modules (nothing downloaded): a single-turn taskset with
an exact-match and a format reward, a ``vf.Env`` that answers a wrong reply with a hint for two
turns, and a taskset whose task has a python tool. The references are verifiers itself
(``Task.score`` on a ``vf.Trace`` the test builds) and hand-computed values."""

import asyncio
import json
import sys
import textwrap

import jax
import numpy as np
import pytest

pytest.importorskip("verifiers.v1")

COMMON = """
import verifiers.v1 as vf

class RevData(vf.TaskData):
    answer: str

class RevTask(vf.Task[RevData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def letters(self, trace) -> float:
        reply = trace.last_reply
        return float(bool(reply) and set(reply) <= set("abcdefgh"))

class RevConfig(vf.TasksetConfig):
    size: int = 6

WORDS = ["abc", "hgfe", "bad", "cafe", "dcbah", "ghe", "fade", "beef"]

class RevTaskset(vf.Taskset[RevTask, RevConfig]):
    def load(self):
        for w in WORDS[: self.config.size]:
            yield RevTask(RevData(prompt=w + "=", answer=w[::-1]), self.config.task)
"""

MODULES = {
    "vf_relax_reverse": COMMON + '\n__all__ = ["RevTaskset"]\n',
    "vf_relax_hint": COMMON
    + """
class HintConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    hints: int = 2

class HintEnv(vf.Env[HintConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as conv:
            seg = await conv.turn()
            for k in range(self.config.hints):
                if seg.last_reply == task.data.answer:
                    break
                seg = await conv.turn(f"hint {k + 1}: it starts with {task.data.answer[0]}")

class HintTask(RevTask):
    @vf.reward(weight=0.1)
    async def turns(self, trace) -> float:
        return float(trace.num_turns)  # the policy's (sampled) turns

class HintTaskset(vf.Taskset[HintTask, RevConfig]):
    def load(self):
        for w in WORDS[: self.config.size]:
            yield HintTask(RevData(prompt=w + "=", answer=w[::-1]), self.config.task)

__all__ = ["HintTaskset", "HintEnv"]
""",
    "vf_relax_tools": '''
import verifiers.v1 as vf

CALLS = []

class Calculator(vf.Toolset):
    TOOL_PREFIX = None  # advertised bare: "multiply"

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        CALLS.append((a, b))
        return a * b

class MulData(vf.TaskData):
    answer: str

class MulTask(vf.Task[MulData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace) -> float:
        return float(len(trace.tool_messages) > 0)

class MulConfig(vf.TasksetConfig):
    size: int = 8

class MulTaskset(vf.Taskset[MulTask, MulConfig]):
    def load(self):
        for i in range(self.config.size):
            a, b = 120 + 7 * i, 13 + i
            yield MulTask(MulData(prompt=f"What is {a} * {b}?", answer=str(a * b)), self.config.task)

__all__ = ["MulTaskset"]
''',
}


@pytest.fixture(scope="module")
def env_modules(tmp_path_factory):
    """The modules written to a directory on ``sys.path`` (verifiers imports a taskset by id)."""
    root = tmp_path_factory.mktemp("vf_envs")
    for name, text in MODULES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def reference_score(task, messages):
    """verifiers' own scoring of ``messages``: a ``vf.Trace`` built here, ``Task.score`` on it."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    nodes = [
        MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
        for i, m in enumerate(messages)
    ]
    trace = Trace(
        task=TraceTask(type="t", data=task.data),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )
    asyncio.run(task.score(trace))
    return {k: r.score for k, r in trace.rewards.items()}, trace.reward


def test_spec_parsing():
    from relax.environments.verifiers_source import parse_spec

    s = parse_spec('verifiers:my_env?size=4&name=abc&opts={"a":1}&tool_format=llama3')
    assert s.taskset == "my_env" and s.tool_format == "llama3"
    assert dict(s.args) == {"size": 4, "name": "abc", "opts": {"a": 1}}
    for bad in (
        "verifiers:",
        "verifiers:x?size",
        "verifiers:x?a=1&a=2",
        "verifiers:x?tool_format=xml",
    ):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_single_turn_rows_and_rewards_equal_the_rubric(env_modules):
    """GRPO's reward functions: one per verifiers reward with its weight, each equal to
    ``Task.score`` on the same messages and to the hand-computed value."""
    import verifiers.v1 as vf

    from relax.environments.verifiers_reward import rubric_functions
    from relax.environments.verifiers_source import load_source
    from relax.rewards.shaping import combine

    spec = "verifiers:vf_relax_reverse?size=3"
    source = load_source(spec)
    rows = source.rows()
    assert [r["prompt"] for r in rows] == ["abc=", "hgfe=", "bad="]
    assert [r["answer"] for r in rows] == ["cba", "efgh", "dab"]
    assert source.single_turn and source.schemas() is None
    fns = rubric_functions(spec)
    assert {f.name: f.weight for f in fns} == {"exact": 1.0, "letters": 0.5}
    completions = ["cba", "abc", "12!"]
    tasks = [r["vf_task"] for r in rows]
    got = {f.name: f.fn([r["prompt"] for r in rows], completions, vf_task=tasks) for f in fns}
    assert got == {"exact": [1.0, 0.0, 0.0], "letters": [1.0, 1.0, 0.0]}  # by hand
    for i, (row, c) in enumerate(zip(rows, completions)):
        task = source.task(row)
        msgs = [vf.UserMessage(content=row["prompt"]), vf.AssistantMessage(content=c)]
        scores, total = reference_score(task, msgs)
        assert {n: got[n][i] for n in got} == scores
        combined, _ = combine(
            {f.name: np.asarray([[got[f.name][i]]], np.float32) for f in fns},
            {f.name: f.weight for f in fns},
        )
        assert float(combined[0, 0]) == pytest.approx(total)  # relax's sum is verifiers' reward


def _tokenizer(tmp_path):
    from text_fixtures import make_model_dir

    from relax.text import load_tokenizer

    return load_tokenizer(make_model_dir(tmp_path, "qwen25"))


def _rollout(tokenizer, spec, rows, max_turns=4, g=2):
    from test_agent_rollout import config, stopping_model

    from relax.environments.chat import ChatFormat
    from relax.environments.rollout import rollout_trajectories
    from relax.environments.verifiers_env import verifiers_factory

    made, factory = [], verifiers_factory(spec)

    def make_env():
        made.append(factory())
        return made[-1]

    chat = ChatFormat(tokenizer, tools=factory().source.schemas())
    cfg = config(g=g, n=200, max_turns=max_turns)
    traj = rollout_trajectories(
        stopping_model(tokenizer), rows, make_env, chat, key=jax.random.key(1), cfg=cfg
    )
    return traj, made, chat


@pytest.mark.slow  # compiles the tiny model's turn programs (~2.5 s)
def test_multi_turn_env_is_token_exact_and_scored_by_its_rubric(env_modules, tmp_path):
    """The hint env's episodes: the policy's turns stay the ids it sampled, the trajectory is the
    chat template's rendering of the final conversation, and the reward is ``Task.score``'s."""
    import verifiers.v1 as vf

    from relax.environments.verifiers_source import load_source

    tokenizer = _tokenizer(tmp_path)
    spec = "verifiers:vf_relax_hint?size=2&hints=2"
    rows = load_source(spec).rows()
    traj, envs, chat = _rollout(tokenizer, spec, rows)
    p, g, n = traj.tokens.shape
    checked = 0
    for t, env in enumerate(envs):
        tokens = traj.tokens.reshape(p * g, n)[t]
        mask = traj.mask.reshape(p * g, n)[t].astype(bool)
        sampled = traj.sampled_mask.reshape(p * g, n)[t].astype(bool)
        replies = [m for m in env.messages if m["role"] == "assistant"]
        if traj.truncated.reshape(-1)[t]:
            continue
        checked += 1
        hints = [m["content"] for m in env.messages if m["role"] == "user"][1:]
        wrong = [m["content"] != rows[t // g]["answer"] for m in replies]
        assert len(hints) == min(2, sum(wrong)) and len(replies) == len(hints) + 1
        # the reference rendering: the whole conversation by the chat template, as text
        prompt = traj.prompt_ids[t // g][traj.prompt_mask[t // g].astype(bool)]
        full = tokenizer.decode(list(prompt) + list(tokens[mask]), skip_special_tokens=False)
        rendered = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in env.messages], tokenize=False
        )
        assert rendered.startswith(full) and rendered[len(full) :].strip() == ""
        # the policy's ids are its turns' text, never re-encoded
        turns = traj.turn_index.reshape(p * g, n)[t]
        for k, reply in enumerate(replies):
            ids = tokens[sampled & (turns == k)]
            assert tokenizer.decode(ids[:-1]) == reply["content"]
        # the reward: verifiers' own score of the same conversation
        msgs = [
            vf.UserMessage(content=m["content"])
            if m["role"] == "user"
            else vf.AssistantMessage(content=m["content"])
            for m in env.messages
        ]
        scores, total = reference_score(env.task, msgs)
        assert traj.rewards.reshape(-1)[t] == pytest.approx(total)
        for name, value in scores.items():
            assert traj.info[f"reward/{name}"].reshape(-1)[t] == value
        assert traj.info["reward/turns"].reshape(-1)[t] == len(replies)  # by hand
    assert checked > 0 and np.all(traj.turns.reshape(-1) >= 1)


def test_tool_calls_reach_the_python_tool(env_modules):
    """A hermes call runs the toolset's method (in this process, through MCP) and its result is
    the tool message; a bad call is an ``error:`` tool message; the final answer is scored."""
    import verifiers.v1 as vf
    import vf_relax_tools

    from relax.environments.protocol import Action
    from relax.environments.verifiers_env import verifiers_factory

    make_env = verifiers_factory("verifiers:vf_relax_tools?size=2")
    env = make_env()
    (schema,) = env.schemas()
    assert schema["function"]["name"] == "multiply"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    row = env.source.rows()[1]

    async def episode():
        opening = await env.areset(row)
        call = '<tool_call>{"name": "multiply", "arguments": {"a": 127, "b": 14}}</tool_call>'
        first = await env.astep(Action(call))
        bad = await env.astep(Action('<tool_call>{"name": "divide", "arguments": {}}</tool_call>'))
        last = await env.astep(Action("1778"))
        return opening, first, bad, last

    vf_relax_tools.CALLS.clear()
    opening, first, bad, last = asyncio.run(episode())
    assert opening == [{"role": "user", "content": "What is 127 * 14?"}]
    assert vf_relax_tools.CALLS == [(127, 14)]
    assert first.observation == [{"role": "tool", "name": "multiply", "content": "1778"}]
    assert not first.done and first.info == {"tool_calls": 1, "tool_errors": 0}
    assert bad.observation[0]["content"].startswith("error: unknown tool 'divide'")
    assert last.done and last.reward == pytest.approx(1.0 * 1.0 + 0.25 * 1.0)
    msgs = [
        vf.UserMessage(content="What is 127 * 14?"),
        vf.AssistantMessage(
            content="c",
            tool_calls=[vf.ToolCall(id="1", name="multiply", arguments='{"a": 127, "b": 14}')],
        ),
        vf.ToolMessage(tool_call_id="1", content="1778"),
        vf.AssistantMessage(content="1778"),
    ]
    scores, total = reference_score(env.task, msgs)
    assert last.reward == pytest.approx(total)
    assert {k: last.info[f"reward/{k}"] for k in scores} == scores
    assert json.loads(env.messages[1]["tool_calls"][0]["arguments"]) == {"a": 127, "b": 14}


def test_grpo_rejects_a_multi_turn_env(env_modules, tmp_path):
    from relax.algorithms.grpo.run import GRPORunConfig
    from relax.algorithms.online.verifiers_setup import verifiers_setup

    cfg = GRPORunConfig(env="verifiers:vf_relax_tools", run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="relax agent"):
        verifiers_setup(cfg, tmp_path, print)
    with pytest.raises(ValueError, match="no --data"):
        GRPORunConfig(env="verifiers:vf_relax_reverse", data="x.jsonl")


@pytest.mark.slow
def test_grpo_trains_on_a_verifiers_env(env_modules, tmp_path):
    """``relax grpo --env verifiers:<id>``: a few steps on the built-in tiny model, with each
    verifiers reward as a metric."""
    import importlib

    import test_agent_run  # noqa: F401 - puts examples/ on sys.path

    train_grpo = importlib.import_module("train_grpo")

    run = tmp_path / "run"
    train_grpo.main(
        [
            "--env", "verifiers:vf_relax_reverse?size=8",
            "--eval-fraction", "0.25",
            "--reverse.sft-steps", "20", "--reverse.num-train", "64", "--reverse.num-eval", "8",
            "--steps", "2", "--batch-size", "2", "--grpo.num-generations", "2",
            "--eval-every", "0", "--checkpoint-every", "2", "--no-export-hf",
            "--run-dir", str(run),
        ]
    )  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "reward" in x]
    assert len(trained) == 2
    assert any("exact" in k for k in trained[0]) and any("letters" in k for k in trained[0])


@pytest.mark.slow
def test_agent_trains_on_a_verifiers_tool_env(env_modules, tmp_path):
    """``relax agent --env verifiers:<id>`` with a tool: a few steps on the built-in tiny model,
    the verifiers rewards reported as ``reward/<name>``."""
    from test_agent_run import FAST, train_agent

    run = tmp_path / "run"
    train_agent.main(
        FAST + ["--env", "verifiers:vf_relax_tools?size=8", "--eval-fraction", "0.25",
                "--run-dir", str(run)]
    )  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "turns" in x]
    assert len(trained) == 2
    assert {"reward/correct", "reward/used_tool", "tool_calls"} <= set(trained[0])
