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
    ``compact_below``: compact the batch once at most this fraction of its rows still run;
    ``min_rows``: the fewest device rows a compaction leaves (a decode step costs about the same
    at 1 and 8 rows on an accelerator, and each device batch size is programs of its own)."""

    turns: T.TurnConfig
    max_turns: int
    compact_below: float = 0.5
    min_rows: int = 8

    def __post_init__(self):
        if min(self.max_turns, self.min_rows) < 1:
            raise ValueError(
                f"max_turns and min_rows must be >= 1, got {self.max_turns}, {self.min_rows}"
            )
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
    longest: Callable[[int], int] = int,
) -> Trajectories:
    """G trajectories of each row (module docstring). ``key``: one PRNG key, or the
    ``len(rows) x G`` trajectories' own keys (``relax.rollout.turns.start_state``).
    ``longest(n)``: the prompt length the batch is padded for (its bucket), given its longest
    prompt's ``n`` (on several processes, sampling parts of one batch: every process's longest)."""
    return asyncio.run(_rollout(model, rows, make_env, chat, key, cfg, longest))


def prompt_width(longest: int, cfg: T.TurnConfig, context: int) -> int:
    """The width prompts of at most ``longest`` tokens are left-padded to (their bucket); a
    ``ValueError`` when such a prompt and the trajectory's slots overflow the model's context."""
    if longest + cfg.max_tokens > context:
        raise ValueError(
            f"a {longest}-token prompt and max_tokens={cfg.max_tokens} overflow the model's context "
            f"of {context} positions"
        )
    return bucket_length(longest, cfg.prompt_buckets)


def _pad_prompts(
    prompts: list[list[int]], width: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def prompt_lengths(
    rows: Sequence[Mapping[str, Any]],
    make_env: Callable[[], Environment | AsyncEnvironment],
    chat: ChatFormat,
    *,
    at_once: int = 256,
) -> list[int]:
    """Each row's prompt length in tokens: a fresh environment reset with the row (``at_once``
    of them concurrently), its conversation rendered by the chat template, as a rollout does."""

    async def lengths(part):
        envs = [as_async(make_env()) for _ in part]
        resets = await asyncio.gather(*(env.areset(row) for env, row in zip(envs, part)))
        return [len(chat.prompt_ids(list(m))) for m in resets]

    out: list[int] = []
    for lo in range(0, len(rows), at_once):
        out += asyncio.run(lengths(rows[lo : lo + at_once]))
    return out


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
    model, rows, make_env, chat: ChatFormat, key, cfg: AgentRolloutConfig, longest
) -> Trajectories:
    tc, g = cfg.turns, cfg.turns.num_generations
    b, n = len(rows) * g, tc.max_tokens
    envs = [as_async(make_env()) for _ in range(b)]
    clock = {"device_s": 0.0, "env_s": 0.0}
    t0 = time.perf_counter()
    prompts = await _reset(envs, rows, g, chat)
    width = prompt_width(longest(max(map(len, prompts))), tc, model.config.max_position_embeddings)
    prompt_ids, prompt_mask = _pad_prompts(prompts, width, tc.pad_id)
    clock["env_s"] += time.perf_counter() - t0
    state = _start(model, prompt_ids, prompt_mask, key, tc)
    layers = T.fused_layers(model, cfg=tc)  # once: every turn's decode and append read them
    rec = _Record(b, n, cfg.max_turns, tc.pad_id, state.routes.shape[2:], state.routes.dtype)
    prompt_routes = np.asarray(state.prompt_routes)
    where = np.arange(b)  # device row -> trajectory (-1: a padding row)
    running = np.ones(b, bool)
    for turn in range(cfg.max_turns):
        t0 = time.perf_counter()
        active = (where >= 0) & running[np.maximum(where, 0)]
        before = np.asarray(state.length)
        state, stopped, count = _decode(model, layers, state, active, tc)
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
            state, where = _compact(state, where, live, rec, cfg)
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
    """Prefill the observations onto their rows' caches, ``tc.observation_chunk`` tokens per
    ``append``; ``length``: the rows' filled slots (host)."""
    rows, chunk = len(where), tc.observation_chunk
    for i, obs in observations.items():
        rec.turn_index[where[i], length[i] : length[i] + len(obs)] = turn
    for lo in range(0, max(map(len, observations.values())), chunk):
        ids = np.full((rows, chunk), tc.pad_id, np.int32)
        count = np.zeros(rows, np.int32)
        for i, obs in observations.items():
            part = obs[lo : lo + chunk]
            ids[i, : len(part)], count[i] = part, len(part)
        state = _append_chunk(model, layers, state, ids, count, tc)
    return state


def _append_chunk(model, layers, state, ids: np.ndarray, count: np.ndarray, tc: T.TurnConfig):
    return T.append(model, state, jnp.asarray(ids), jnp.asarray(count), cfg=tc, layers=layers)


def _decode(model, layers, state, active: np.ndarray, tc: T.TurnConfig):
    return T.decode_turn(model, state, jnp.asarray(active), cfg=tc, layers=layers)


def _start(model, prompt_ids: np.ndarray, prompt_mask: np.ndarray, key, tc: T.TurnConfig):
    return T.start(model, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), key, cfg=tc)


def compact_sizes(trajectories: int, cfg: AgentRolloutConfig) -> tuple[int, ...]:
    """The device batch sizes a rollout of ``trajectories`` runs at, largest first: all of them,
    then each power of two below that is at least ``cfg.min_rows`` (``_compact`` goes down them
    one at a time)."""
    floor = 1 << (cfg.min_rows - 1).bit_length()  # the least power of two >= min_rows
    top = 1 << (trajectories - 1).bit_length()
    return (trajectories, *(s for s in _halvings(top) if floor <= s < trajectories))


def _halvings(size: int) -> list[int]:
    return [size >> i for i in range(size.bit_length())]


def _compact(state, where, live: np.ndarray, rec: _Record, cfg: AgentRolloutConfig):
    """Keep the device rows ``live``, going down ``compact_sizes`` to the least size that holds
    them (each step a ``compact`` to the next size, padded with a copy of a live row marked -1)."""
    sizes = [s for s in compact_sizes(len(where), cfg) if s >= live.size]
    if len(sizes) == 1:
        return state, where
    rec.flush(state, where)
    for size in sizes[1:]:
        keep = np.concatenate([live, np.full(size - live.size, live[0])])
        where = np.concatenate([where[live], np.full(size - live.size, -1)])
        state, live = _compact_to(state, keep), np.arange(live.size)
    return state, where


def _compact_to(state, keep: np.ndarray):
    return T.compact(state, jnp.asarray(keep, jnp.int32))


def warm_rollout(
    model: Transformer, prompts: int, width: int, *, key: jax.Array, cfg: AgentRolloutConfig
) -> list[tuple[str, float]]:
    """Call once, on placeholder rows, every device program a rollout of ``prompts`` rows with
    prompts padded to ``width`` can call, as ``rollout_trajectories`` calls them: each compiles
    now, not when a batch first needs it. ``key`` as ``rollout_trajectories``'. Returns each
    program's name and seconds (its compiles, mostly).

    ``start`` and the fused weights, then at each of ``compact_sizes`` the turn's programs on
    every state a rollout can hand them: ``decode_turn`` (no row running) after ``start``, a
    compaction, an append or a turn; ``append`` (of nothing) after a turn; the ``compact`` down
    to the next size after a turn or an append. On a mesh a program may lay its results out
    otherwise than its arguments (another program for the next call), so each is called on each
    layout met until no new one appears."""
    tc, timed = cfg.turns, {}

    def run(name: str, fn: Callable, *args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        name = f"{name} [{prompts} prompts of {width}]"
        timed[name] = timed.get(name, 0.0) + time.perf_counter() - t0
        return out

    ones = np.ones((prompts, width), np.int32)
    state = run("start", _start, model, ones, ones, key, tc)
    layers = run("fused_layers", lambda m: T.fused_layers(m, cfg=tc), model)
    sizes = compact_sizes(prompts * tc.num_generations, cfg)
    entering = [state]
    for size, smaller in zip(sizes, (*sizes[1:], None), strict=True):
        idle, nothing = np.zeros(size, bool), np.zeros(size, np.int32)
        zeros = np.zeros((size, tc.observation_chunk), np.int32)
        todo, seen, entering = [("enter", s) for s in entering], set(), []
        while todo:
            after, state = todo.pop()
            if (after, _layout(state)) in seen:
                continue
            seen.add((after, _layout(state)))
            if smaller is not None and after != "enter":
                compact = f"compact {size} to {smaller}"
                entering.append(run(compact, _compact_to, state, np.arange(smaller)))
            if after == "turn":
                copy = jax.tree.map(lambda x: x.copy(), state)
                todo.append(
                    (
                        "append",
                        run(
                            f"append {size} rows",
                            _append_chunk,
                            model,
                            layers,
                            copy,
                            zeros,
                            nothing,
                            tc,
                        ),
                    )
                )
            decoded, *_ = run(f"decode_turn {size} rows", _decode, model, layers, state, idle, tc)
            todo.append(("turn", decoded))
    return list(timed.items())


def _layout(state) -> tuple:
    """How ``state``'s arrays are laid out: each leaf's sharding and whether it is committed."""
    return tuple((x.sharding, x.committed) for x in jax.tree.leaves(state))


def placeholder_trajectories(
    model: Transformer, prompts: int, width: int, cfg: AgentRolloutConfig
) -> Trajectories:
    """Zeros in the shapes and dtypes ``rollout_trajectories`` gives for ``prompts`` rows padded
    to ``width`` (e.g. to compile what follows a rollout before one runs); ``model`` may be
    abstract (``ShapeDtypeStruct`` leaves): it gives the routes' shapes. No environment runs."""
    tc, g = cfg.turns, cfg.turns.num_generations
    ids = jax.ShapeDtypeStruct((prompts, width), jnp.int32)
    state = jax.eval_shape(
        lambda m, i, k: T.start_state(m, i, i, k, tc), model, ids, jax.random.key(0)
    )
    routes = state.routes
    rec = _Record(
        prompts * g, tc.max_tokens, cfg.max_turns, tc.pad_id, routes.shape[2:], routes.dtype
    )
    zeros = np.zeros((prompts, width), np.int32)
    prompt_routes = np.zeros(state.prompt_routes.shape, state.prompt_routes.dtype)
    clock = {"device_s": 0.0, "env_s": 0.0}
    return _trajectories(rec, zeros, zeros.copy(), prompt_routes, prompts, g, clock)


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
