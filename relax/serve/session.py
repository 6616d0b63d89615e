"""A client's training session: its own LoRA adapters over the service's shared base model.

    session = Session.create("s1", base, LoRAConfig(rank=8), seed=0)
    metrics, outputs = session.forward_backward(request)     # gradients summed into session.pending
    session.optim_step({"learning_rate": 1e-4})               # one Adam step on them, then cleared

A session holds a ``TrainState`` whose policy is the base with the session's adapters (the base's
arrays shared by every session, not copied), the gradients accumulated since its last
``optim_step``, and its sampler snapshots (``save_weights_for_sampler``). Every request is checked
before anything is computed, and the state is replaced only once a request has succeeded: a
refused or failed request leaves the session as it was. Randomness is the session's own (its seed,
and a counter of its sampling calls), so a session's results depend only on its own requests.

Optimizer: ``clip_by_global_norm(max_grad_norm) -> adamw`` with every hyperparameter injected
(``optax.inject_hyperparams``), set from each ``optim_step``'s ``AdamParams``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from relax.models.adapters.operations import add_lora
from relax.models.config.sharding import mesh_of
from relax.models.decoder.transformer import Transformer
from relax.models.heads.critic import init_value_head
from relax.models.layers.lora import LoRAConfig
from relax.parallel.mesh import state_shardings
from relax.rollout.sampler import RolloutConfig, generate_with
from relax.rollout.sampling import SamplingConfig
from relax.serve import objectives
from relax.serve.datum import datum_loss, datum_rows
from relax.serve.objectives import Grads
from relax.serve.placement import place_rows, shards
from relax.serve.wire import RequestError, decode_batch
from relax.train import primitives
from relax.train.state import TrainState, init_state

__all__ = ["ADAM_DEFAULTS", "OPTIMIZER", "Session"]

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "max_grad_norm": None,
}
_TOKEN_FIELDS = ("prompt_ids", "tokens", "ids")
NOT_SERVED = {
    "reward_modeling": "a session trains a causal LM (with adapters, and a value head if asked for); "
    "reward_modeling trains a reward model's score head, which no session has: train "
    "reward models with examples/train_reward_model.py or relax.serve.objectives in-process"
}


def _adam(learning_rate, b1, b2, eps, weight_decay, max_grad_norm):
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
    )


OPTIMIZER = optax.inject_hyperparams(_adam)(
    learning_rate=1e-4, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0, max_grad_norm=math.inf
)


def _adam_hyperparams(params: Any) -> dict[str, float]:
    """``_adam``'s hyperparameters from an ``AdamParams`` map (each checked, named as sent)."""
    if not isinstance(params, dict) or set(params) - set(ADAM_DEFAULTS):
        raise RequestError("adam_params", f"a map with keys among {', '.join(ADAM_DEFAULTS)}")
    p = {**ADAM_DEFAULTS, **params}
    if p["max_grad_norm"] is None:
        p["max_grad_norm"] = math.inf
    for k, v in p.items():
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or math.isnan(v)
            or v < 0
            or (k != "max_grad_norm" and math.isinf(v))
        ):
            raise RequestError(f"adam_params.{k}", f"must be a finite number >= 0, got {v!r}")
    if not (
        0 <= p["beta1"] < 1
        and 0 <= p["beta2"] < 1
        and p["learning_rate"] > 0
        and p["max_grad_norm"] > 0
    ):
        raise RequestError(
            "adam_params", "needs learning_rate > 0, 0 <= beta1, beta2 < 1, max_grad_norm > 0"
        )
    return {
        "learning_rate": p["learning_rate"],
        "b1": p["beta1"],
        "b2": p["beta2"],
        "eps": p["eps"],
        "weight_decay": p["weight_decay"],
        "max_grad_norm": p["max_grad_norm"],
    }


@jax.jit
def _finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


@jax.jit
def _accumulate(pending, grads):
    return jax.tree.map(jnp.add, pending, grads)


@jax.jit
def _optim(state: TrainState, grads: Grads, hyper: dict):
    def injected(opt_state):
        return (
            None
            if opt_state is None
            else opt_state._replace(
                hyperparams={k: jnp.asarray(v, jnp.float32) for k, v in hyper.items()}
            )
        )

    state = state.replace(
        opt_state=injected(state.opt_state), critic_opt_state=injected(state.critic_opt_state)
    )
    new = objectives.objective_optim_step(state, grads)
    return new, optax.tree.norm(grads.policy)


@dataclasses.dataclass
class Session:
    """One client's session (module docstring). ``lora`` and ``seed`` are what it was created with."""

    id: str
    lora: LoRAConfig
    seed: int
    state: (
        TrainState | None
    )  # None: the holder of base-model sampling draws (Service._base_session)
    value_head: bool = (
        False  # state.critic is a ValueHead on the policy's backbone (objective "ppo")
    )
    pending: Grads | None = None
    samplers: dict[str, Any] = dataclasses.field(default_factory=dict)
    evicted: int = 0  # sampler snapshots dropped for newer ones
    draws: itertools.count = dataclasses.field(default_factory=itertools.count)

    @classmethod
    def create(
        cls,
        sid: str,
        base: Transformer,
        lora: LoRAConfig,
        seed: int,
        mesh: Mesh | None = None,
        *,
        value_head: bool = False,
    ) -> Session:
        """A fresh session; with ``value_head`` its state has a zero-initialised ``ValueHead`` on the
        policy's backbone (trained by PPO's joint loss, its own Adam state, the same step
        hyperparameters). On ``mesh`` its state is laid out by the parameter rules
        (``relax.parallel.mesh.state_shardings``: the base's shards as they are, adapters and
        moments like their weights)."""
        key = jax.random.key(seed)
        policy = add_lora(base, lora, jax.random.fold_in(key, 0)) if lora.enabled else base
        critic = init_value_head(base.config) if value_head else None
        state = init_state(
            policy,
            OPTIMIZER,
            key=jax.random.fold_in(key, 1),
            critic=critic,
            critic_optimizer=OPTIMIZER if value_head else None,
        )
        if mesh is not None:
            state = jax.device_put(state, state_shardings(state, mesh))
        return cls(sid, lora, seed, state, value_head)

    @property
    def config(self):
        return self.state.policy.config

    # ------------------------------------------------------------------ forward_backward

    def _check_tokens(self, batch) -> None:
        for name in _TOKEN_FIELDS:
            a = getattr(batch, name, None)
            if a is not None and a.size and (a.min() < 0 or a.max() >= self.config.vocab_size):
                raise RequestError(
                    f"batch.{name}", f"token ids must be in [0, {self.config.vocab_size})"
                )

    def _loss_and_grads(self, request: dict, backward: bool):
        loss, config = request.get("loss_fn"), request.get("loss_fn_config") or {}
        if not isinstance(loss, str):
            raise RequestError("loss_fn", "the loss's name (a string) is needed")
        if not isinstance(config, dict):
            raise RequestError("loss_fn_config", "a map of the loss's options is needed")
        config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
        try:
            hash(tuple(config.items()))
        except TypeError:
            raise RequestError(
                "loss_fn_config", "options are numbers, strings, booleans or lists of them"
            ) from None
        if ("data" in request) == ("batch" in request):
            raise RequestError(
                "data", "send either data (a list of datums) or batch (a typed batch)"
            )
        if "data" in request:
            mesh = mesh_of(self.state)
            rows, lengths = datum_rows(
                request["data"],
                loss,
                self.config.vocab_size,
                self.config.max_position_embeddings,
                rows_multiple=shards(mesh),
            )
            rows = place_rows(rows, mesh, "data")
            grads, metrics, logp = _datum_step(loss, config, backward)(self.state, rows)
            logp = np.asarray(logp)  # one copy to host, then sliced per datum
            outputs = [{"logprobs": logp[i, :n]} for i, n in enumerate(lengths)]
            return grads, metrics, outputs
        batch = decode_batch(request["batch"], "batch")
        self._check_tokens(batch)
        if loss not in objectives.OBJECTIVES:
            raise RequestError(
                "loss_fn",
                f"unknown objective {loss!r}; valid: {', '.join(sorted(objectives.OBJECTIVES))}",
            )
        if loss in NOT_SERVED:
            raise RequestError("loss_fn", NOT_SERVED[loss])
        batch = place_rows(batch, mesh_of(self.state), "batch")
        try:
            grads, metrics = _objective_step(loss, tuple(sorted(config.items())), backward)(
                self.state, batch
            )
        except (TypeError, ValueError) as e:  # the objective's own checks, at trace time
            raise RequestError("loss_fn_config" if config else "batch", str(e)) from None
        return grads, metrics, []

    def forward_backward(self, request: dict, *, backward: bool = True) -> tuple[dict, list]:
        """The loss's metrics and per-datum outputs; with ``backward`` its gradients are added to
        ``pending``. A non-finite loss or gradient is refused: nothing is added."""
        grads, metrics, outputs = self._loss_and_grads(request, backward)
        metrics = {k: float(v) for k, v in metrics.items()}
        if backward:
            if not (math.isfinite(metrics["loss"]) and bool(_finite(grads))):
                raise RequestError(
                    "data" if "data" in request else "batch",
                    f"the loss or its gradients are not finite (loss {metrics['loss']}); "
                    "nothing was accumulated",
                )
            self.pending = grads if self.pending is None else _accumulate(self.pending, grads)
        return metrics, outputs

    # ------------------------------------------------------------------ optimizer, sampling

    def optim_step(self, adam_params: Any) -> dict:
        """One step on the accumulated gradients with ``adam_params``; clears them."""
        hyper = _adam_hyperparams(adam_params or {})
        if self.pending is None:
            raise RequestError(
                "optim_step", "no gradients accumulated since the last step: call forward_backward"
            )
        state, norm = _optim(self.state, self.pending, hyper)
        self.state, self.pending = state, None
        return {
            "step": int(state.step),
            "grad_norm": float(norm),
            "learning_rate": hyper["learning_rate"],
        }

    def snapshot(self, name: str, keep: int) -> None:
        """Keep the policy as it is now for sampling under ``name`` (``save_weights_for_sampler``),
        and only the newest ``keep`` snapshots: an older one is dropped (its adapters freed)."""
        self.samplers.pop(name, None)
        self.samplers[name] = self.state.policy
        while len(self.samplers) > keep:
            self.samplers.pop(next(iter(self.samplers)))
            self.evicted += 1

    def sample(self, policy, request: dict) -> list[dict]:
        """``num_samples`` completions of each of ``request["prompts"]`` by ``policy``."""
        prompts, n, params = (
            request.get("prompts"),
            request.get("num_samples", 1),
            request.get("sampling_params") or {},
        )
        if not isinstance(prompts, list) or not prompts:
            raise RequestError("prompts", "a non-empty list of token arrays is needed")
        if not isinstance(n, int) or n < 1:
            raise RequestError("num_samples", f"must be an integer >= 1, got {n!r}")
        config = policy.config
        cfg = self._rollout_config(params, n, config.eos_ids)
        ok = all(isinstance(p, np.ndarray) and p.ndim == 1 and p.size for p in prompts)
        lp = max(len(p) for p in prompts) if ok else 0
        if lp == 0 or lp + cfg.max_new_tokens > config.max_position_embeddings:
            raise RequestError(
                "prompts",
                f"each prompt must be a non-empty 1-D token array, prompt plus max_tokens "
                f"at most {config.max_position_embeddings} positions",
            )
        ids, mask = np.zeros((len(prompts), lp), np.int32), np.zeros((len(prompts), lp), np.int32)
        for i, p in enumerate(prompts):
            if p.dtype.kind not in "iu" or p.min() < 0 or p.max() >= config.vocab_size:
                raise RequestError(
                    f"prompts[{i}]", f"token ids must be integers in [0, {config.vocab_size})"
                )
            ids[i, lp - len(p) :], mask[i, lp - len(p) :] = p, 1
        key = self._key(params)  # after every check: a refused request draws nothing
        placed = place_rows({"prompt_ids": ids, "prompt_mask": mask}, mesh_of(policy), None)
        try:
            r = generate_with(policy, placed["prompt_ids"], placed["prompt_mask"], key, cfg)
        except ValueError as e:
            raise RequestError("prompts", str(e)) from None
        tokens, logprobs = np.asarray(r.tokens), np.asarray(r.logprobs)
        lengths, finished = np.asarray(r.lengths), np.asarray(r.finished)
        return [
            [
                {
                    "tokens": tokens[i, g, : lengths[i, g]],
                    "logprobs": logprobs[i, g, : lengths[i, g]],
                    "stop_reason": "stop" if finished[i, g] else "length",
                }
                for g in range(n)
            ]
            for i in range(len(prompts))
        ]

    def _rollout_config(self, params: dict, n: int, eos_ids: tuple[int, ...]) -> RolloutConfig:
        known = {"max_tokens", "temperature", "top_k", "top_p", "stop", "seed"}
        if not isinstance(params, dict) or set(params) - known:
            raise RequestError(
                "sampling_params", f"a map with keys among {', '.join(sorted(known))}"
            )
        top_k, top_p = params.get("top_k", -1), params.get("top_p", 1.0)
        try:
            stop = tuple(int(s) for s in params.get("stop") or ())
            sampling = SamplingConfig(
                temperature=float(params.get("temperature", 1.0)),
                top_k=None if top_k in (None, -1) else int(top_k),
                top_p=None if top_p in (None, 1.0) else float(top_p),
            )
            return RolloutConfig(
                num_generations=n,
                max_new_tokens=int(params.get("max_tokens", 16)),
                sampling=sampling,
                eos_ids=tuple(sorted({*eos_ids, *stop})),
                pad_id=0,
            )
        except (TypeError, ValueError) as e:
            raise RequestError("sampling_params", str(e)) from None

    def _key(self, params: dict) -> jax.Array:
        seed = params.get("seed")
        if seed is not None:
            if not isinstance(seed, int):
                raise RequestError("sampling_params.seed", f"an integer or None, got {seed!r}")
            return jax.random.key(seed)
        return jax.random.fold_in(
            jax.random.fold_in(jax.random.key(self.seed), 2), next(self.draws)
        )


_CACHE: dict = {}


def _objective_step(loss: str, config: tuple, backward: bool):
    """The jitted ``(state, batch) -> (grads, metrics)`` of a named objective (cached per options)."""
    key = ("objective", loss, config, backward)
    if key not in _CACHE:
        kwargs = dict(config)

        def step(state, batch):
            if backward:
                return objectives.objective_forward_backward(state, batch, loss, **kwargs)
            params, loss_fn = objectives.objective_loss(state, batch, loss, **kwargs)
            value, metrics = loss_fn(params)
            return None, {**{k: getattr(v, "value", v) for k, v in metrics.items()}, "loss": value}

        _CACHE[key] = jax.jit(step)
    return _CACHE[key]


def _datum_step(loss: str, config: dict, backward: bool):
    """The jitted ``(state, rows) -> (grads, metrics, logp)`` of a datum loss (cached per options)."""
    fn = datum_loss(loss, config)  # checks the name and options first
    key = ("datum", loss, tuple(sorted(config.items())), backward)
    if key not in _CACHE:

        def step(state, rows):
            if not backward:
                value, (logp, metrics) = fn(state.policy, rows)
                return None, {**metrics, "loss": value}, logp
            grads, metrics = primitives.forward_backward(state, rows, lambda p, r: _swap(fn(p, r)))
            return Grads(grads), {k: v for k, v in metrics.items() if k != "logp"}, metrics["logp"]

        _CACHE[key] = jax.jit(step)
    return _CACHE[key]


def _swap(out):
    value, (logp, metrics) = out
    return value, {**metrics, "logp": logp}
