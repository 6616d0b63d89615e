"""Multi-turn rollouts: a batch of environments stepped together over the cache-carrying sampler.

    chat = ChatFormat(tokenizer, tools=env.schemas())
    traj = rollout_trajectories(policy, rows, make_env, chat, key=key, cfg=AgentRolloutConfig(...))

For P rows and G trajectories each: every trajectory gets its own environment (``make_env()``),
``reset`` with its row; the prompt (the G resets of a row must agree) is rendered by the chat
template and prefilled once (``relax.rollout.turns``). Then, turn by turn:

1. the device samples one turn of every running trajectory (``decode_turn``);
2. the host decodes each turn's text (without its stop token) and steps the environments
   concurrently (``asyncio``; synchronous environments run in threads, ``as_async``), with the
   sampled ids in ``Action.token_ids``;
3. each observation is rendered and tokenized once (``ChatFormat.observation_ids``) and prefilled
   onto the trajectory's cache (``append``);
4. when few trajectories still run, the batch is compacted to them (``compact``).

A trajectory ends when its environment says ``done``; it is **truncated** (flagged, its rewards so
far kept) when a turn hits ``max_turn_tokens`` without a stop token, when the next observation
would not fit in ``max_tokens``, or after ``max_turns`` turns; an environment that raises ends
its trajectory with reward NaN and the error recorded (the agent trainers leave its tokens out of
the loss mask: ``relax.algorithms.agent.step``). The sampled ids
are never decoded and re-encoded: ``tokens`` holds them as sampled, ``sampled_mask`` marks them,
and observation tokens are in ``mask`` (attended) but never in ``sampled_mask`` (the loss).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from relax.environments.chat import ChatFormat
from relax.environments.protocol import Action, AsyncEnvironment, Environment, as_async
from relax.models.decoder.transformer import Transformer
from relax.models.forward.routes import Routes
from relax.rollout import turns as T
from relax.rollout.sampler import bucket_length


@dataclasses.dataclass(frozen=True)
class AgentRolloutConfig:
    """``turns``: the device programs' config; ``max_turns``: policy turns per trajectory;
    ``compact_below``: compact the batch once at most this fraction of its rows still run."""

    turns: T.TurnConfig
    max_turns: int
    compact_below: float = 0.5

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 0.0 <= self.compact_below <= 1.0:
            raise ValueError(f"compact_below must be in [0, 1], got {self.compact_below}")


class Trajectories(NamedTuple):
    """P x G trajectories as host arrays: tokens and masks ``[P, G, N]``, per-turn rewards
    ``[P, G, max_turns]``, the rest ``[P, G]``. ``turn_index``: the turn a slot belongs to (its
    sampled tokens and the observation after it), -1 past the end; ``info``: the environments'
    numeric ``info`` summed per trajectory (e.g. ``tool_calls``, ``tool_errors``)."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    sampled_mask: np.ndarray
    logprobs: np.ndarray
    turn_index: np.ndarray
    turn_rewards: np.ndarray
    rewards: np.ndarray
    turns: np.ndarray
    truncated: np.ndarray
    env_errors: list[str | None]
    info: dict[str, np.ndarray]
    timings: dict[str, float]
    routes: Routes | None = (
        None  # a mixture of experts' choices of every token (relax.models.forward.routes)
    )


class _Record:
    """Host copies of the per-trajectory results, filled as rows leave the device batch."""

    def __init__(
        self,
        b: int,
        n: int,
        max_turns: int,
        pad_id: int,
        route_shape: tuple[int, ...] = (0, 1),
        route_dtype=np.int8,
    ):
        self.tokens = np.full((b, n), pad_id, np.int32)
        self.routes = np.full(
            (b, n, *route_shape), -1, route_dtype
        )  # a mixture of experts' choices
        self.logprobs = np.zeros((b, n), np.float32)
        self.sampled = np.zeros((b, n), bool)
        self.length = np.zeros(b, np.int32)
        self.turn_index = np.full((b, n), -1, np.int32)
        self.turn_rewards = np.zeros((b, max_turns), np.float32)
        self.turns = np.zeros(b, np.int32)
        self.truncated = np.zeros(b, bool)
        self.errors: list[str | None] = [None] * b
        self.info: dict[str, np.ndarray] = {}

    def flush(self, state: T.TurnState, where: np.ndarray):
        tokens, logprobs, sampled, length, routes = jax.device_get(
            (state.tokens, state.logprobs, state.sampled, state.length, state.routes)
        )
        rows = np.nonzero(where >= 0)[0]
        for name, src in (
            ("tokens", tokens),
            ("logprobs", logprobs),
            ("sampled", sampled),
            ("length", length),
            ("routes", routes),
        ):
            getattr(self, name)[where[rows]] = src[rows]

    def add_info(self, b: int, info: Mapping[str, Any], size: int):
        for k, v in info.items():
            if isinstance(v, (bool, int, float, np.number)):
                self.info.setdefault(k, np.zeros(size, np.float32))[b] += float(v)


def rollout_trajectories(
    model: Transformer,
    rows: Sequence[Mapping[str, Any]],
    make_env: Callable[[], Environment | AsyncEnvironment],
    chat: ChatFormat,
    *,
    key: jax.Array,
    cfg: AgentRolloutConfig,
) -> Trajectories:
    """G trajectories of each row (module docstring). ``key``: one PRNG key, or the
    ``len(rows) x G`` trajectories' own keys (``relax.rollout.turns.start_state``)."""
    return asyncio.run(_rollout(model, rows, make_env, chat, key, cfg))


def _pad_prompts(
    prompts: list[list[int]], cfg: T.TurnConfig, context: int
) -> tuple[np.ndarray, np.ndarray]:
    longest = max(map(len, prompts))
    if longest + cfg.max_tokens > context:
        raise ValueError(
            f"a {longest}-token prompt and max_tokens={cfg.max_tokens} overflow the model's context "
            f"of {context} positions"
        )
    width = bucket_length(longest, cfg.prompt_buckets)
    ids = np.full((len(prompts), width), cfg.pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


async def _reset(envs, rows, g: int, chat: ChatFormat) -> list[list[int]]:
    resets = await asyncio.gather(*(env.areset(rows[b // g]) for b, env in enumerate(envs)))
    prompts = []
    for p in range(len(rows)):
        group = [list(m) for m in resets[p * g : (p + 1) * g]]
        if any(m != group[0] for m in group):
            raise ValueError(
                f"row {p}: the environment's reset gave the {g} trajectories of one row different "
                "conversations; they share one prompt"
            )
        prompts.append(chat.prompt_ids(group[0]))
    return prompts


async def _step(env: AsyncEnvironment, action: Action | None):
    if action is None:
        return None
    try:
        return await env.astep(action)
    except Exception as exc:  # noqa: BLE001 - an environment's failure ends its trajectory, not the batch
        return exc


async def _rollout(
    model, rows, make_env, chat: ChatFormat, key, cfg: AgentRolloutConfig
) -> Trajectories:
    tc, g = cfg.turns, cfg.turns.num_generations
    b, n = len(rows) * g, tc.max_tokens
    envs = [as_async(make_env()) for _ in range(b)]
    clock = {"device_s": 0.0, "env_s": 0.0}
    t0 = time.perf_counter()
    prompt_ids, prompt_mask = _pad_prompts(
        await _reset(envs, rows, g, chat), tc, model.config.max_position_embeddings
    )
    clock["env_s"] += time.perf_counter() - t0
    state = T.start(model, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), key, cfg=tc)
    layers = T.fused_layers(model, cfg=tc)  # once: every turn's decode and append read them
    rec = _Record(b, n, cfg.max_turns, tc.pad_id, state.routes.shape[2:], state.routes.dtype)
    prompt_routes = np.asarray(state.prompt_routes)
    where = np.arange(b)  # device row -> trajectory (-1: a padding row)
    running = np.ones(b, bool)
    for turn in range(cfg.max_turns):
        t0 = time.perf_counter()
        active = (where >= 0) & running[np.maximum(where, 0)]
        before = np.asarray(state.length)
        state, stopped, count = T.decode_turn(
            model, state, jnp.asarray(active), cfg=tc, layers=layers
        )
        tokens, stopped, count = jax.device_get((state.tokens, stopped, count))
        clock["device_s"] += time.perf_counter() - t0
        actions: list[Action | None] = [None] * b
        for i in np.nonzero(active)[0]:
            t, lo, hi = where[i], before[i], before[i] + count[i]
            rec.turn_index[t, lo:hi], rec.turns[t] = turn, turn + 1
            if not stopped[i]:  # the turn or total budget ran out mid-turn
                rec.truncated[t], running[t] = True, False
                continue
            ids = tokens[i, lo:hi]
            actions[t] = Action(chat.tokenizer.decode(ids[:-1]), tuple(int(x) for x in ids))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_step(envs[t], actions[t]) for t in range(b)))
        observations = _observe(
            results, actions, rec, running, turn, cfg, before + count, where, chat
        )
        clock["env_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        if observations:
            state = _append(
                model, layers, state, observations, before + count, where, rec, turn, tc
            )
        live = np.nonzero((where >= 0) & running[np.maximum(where, 0)])[0]
        if live.size == 0:
            break
        if live.size <= cfg.compact_below * len(where):
            state, where = _compact(state, where, live, rec)
        clock["device_s"] += time.perf_counter() - t0
    rec.truncated |= running  # still running after max_turns
    rec.flush(state, where)
    return _trajectories(rec, prompt_ids, prompt_mask, prompt_routes, len(rows), g, clock)


def _observe(
    results,
    actions,
    rec: _Record,
    running,
    turn: int,
    cfg: AgentRolloutConfig,
    length,
    where,
    chat: ChatFormat,
) -> dict[int, list[int]]:
    """Record each stepped environment's result; the observation ids of the trajectories that go on."""
    row_of = {int(t): i for i, t in enumerate(where) if t >= 0}
    out = {}
    for t, (res, action) in enumerate(zip(results, actions)):
        if action is None:
            continue
        if isinstance(res, BaseException):
            rec.errors[t] = f"{type(res).__name__}: {res}"
            rec.turn_rewards[t, turn], running[t] = np.nan, False
            continue
        rec.turn_rewards[t, turn] = 0.0 if res.reward is None else float(res.reward)
        rec.add_info(t, res.info, len(actions))
        if res.done:
            running[t] = False
            continue
        ids = chat.observation_ids(res.observation) if res.observation else []
        if turn + 1 >= cfg.max_turns or length[row_of[t]] + len(ids) >= cfg.turns.max_tokens:
            rec.truncated[t], running[t] = (
                True,
                False,
            )  # no turn left, or no room for one more token
            continue
        if ids:
            out[row_of[t]] = ids
    return out


def _append(
    model,
    layers,
    state,
    observations: dict[int, list[int]],
    length,
    where,
    rec: _Record,
    turn: int,
    tc: T.TurnConfig,
):
    """Prefill the observations onto their rows' caches; ``length``: the rows' filled slots (host)."""
    rows = len(where)
    width = bucket_length(max(map(len, observations.values())), tc.observation_buckets)
    ids = np.full((rows, width), tc.pad_id, np.int32)
    count = np.zeros(rows, np.int32)
    for i, obs in observations.items():
        ids[i, : len(obs)], count[i] = obs, len(obs)
        rec.turn_index[where[i], length[i] : length[i] + len(obs)] = turn
    return T.append(model, state, jnp.asarray(ids), jnp.asarray(count), cfg=tc, layers=layers)


def _compact(state, where, live: np.ndarray, rec: _Record):
    """Keep the device rows ``live`` (padded to a power of two with a copy marked -1)."""
    rec.flush(state, where)
    size = 1 << int(np.ceil(np.log2(live.size)))
    if size >= len(where):
        return state, where
    keep = np.concatenate([live, np.full(size - live.size, live[0])])
    new_where = np.concatenate([where[live], np.full(size - live.size, -1)])
    return T.compact(state, jnp.asarray(keep, jnp.int32)), new_where


def _trajectories(
    rec: _Record, prompt_ids, prompt_mask, prompt_routes, p: int, g: int, clock
) -> Trajectories:
    n = rec.tokens.shape[1]
    shape = lambda x: x.reshape((p, g) + x.shape[1:])  # noqa: E731
    mask = np.arange(n)[None, :] < rec.length[:, None]
    rewards = rec.turn_rewards.sum(axis=1)  # NaN where an environment raised
    rec.turn_index[~mask] = -1
    return Trajectories(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        tokens=shape(rec.tokens),
        mask=shape(mask.astype(np.int32)),
        sampled_mask=shape(rec.sampled.astype(np.int32)),
        logprobs=shape(rec.logprobs),
        turn_index=shape(rec.turn_index),
        turn_rewards=shape(rec.turn_rewards),
        rewards=shape(rewards),
        turns=shape(rec.turns),
        truncated=shape(rec.truncated),
        env_errors=rec.errors,
        info={k: shape(v) for k, v in rec.info.items()},
        timings=dict(clock),
        routes=None
        if not rec.routes.shape[2]
        else Routes(prompt=prompt_routes, completion=shape(rec.routes)),
    )
