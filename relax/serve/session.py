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

Bounds: every request is measured before anything is allocated or compiled (``Bounds``: the
service's ``--limits``, and ``relax.serve.memory``'s floor against its devices' free memory),
and runs through the service's compiled programs (``relax.serve.programs``, the steps of
``relax.serve.steps``), each checked against the free memory by XLA's count before it runs. A
result is kept only when it is finite: gradients whose loss, gradient norm or sum with the
pending ones is not, and an optimizer step whose new weights or moments are not, are refused and
the session stays exactly as it was (its pending gradients too).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from relax.models.adapters.operations import add_lora, split_trainable
from relax.models.config.sharding import mesh_of
from relax.models.decoder.transformer import Transformer
from relax.models.heads.critic import init_value_head
from relax.models.layers.lora import LoRAConfig
from relax.parallel.mesh import state_shardings
from relax.rollout.config import bucket_length, validate
from relax.rollout.sampler import RolloutConfig
from relax.rollout.sampling import SamplingConfig
from relax.serve import memory, objectives, steps
from relax.serve.datum import datum_lengths, datum_loss, pack_rows, row_shape, tinker_options
from relax.serve.limits import ServiceLimits, over
from relax.serve.objectives import Grads
from relax.serve.options import (
    ADAM_DEFAULTS,
    adam_hyperparams,
    batch_extent,
    loss_options,
    sampling_options,
)
from relax.serve.placement import place_rows, shards
from relax.serve.programs import ProgramCache
from relax.serve.steps import OPTIMIZER
from relax.serve.wire import RequestError, decode_batch
from relax.train.state import TrainState, init_state

__all__ = ["ADAM_DEFAULTS", "OPTIMIZER", "Bounds", "Session"]

_TOKEN_FIELDS = ("prompt_ids", "tokens", "ids")
NOT_SERVED = {
    "reward_modeling": "a session trains a causal LM (with adapters, and a value head if asked for); "
    "reward_modeling trains a reward model's score head, which no session has: train "
    "reward models with examples/train_reward_model.py or relax.serve.objectives in-process"
}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a session's requests are checked against and run by: the service's limits, its
    devices (whose free memory a request's estimate must fit) and its compiled programs."""

    limits: ServiceLimits
    devices: tuple
    programs: ProgramCache

    def fits(self, field: str, need: int, what: str) -> None:
        memory.check_fits(field, need, list(self.devices), self.limits.memory_mb, what)

    def run(self, field: str, what: str, key: tuple, step, numbers: dict, *args):
        """``step`` run by the service's programs, refused (413 naming ``field``) first if what
        its compiled program allocates does not fit."""
        fits = lambda need: self.fits(field, need, f"{what} (by XLA's count of its program)")
        return self.programs.run(key, step, numbers, *args, fits=fits)

    def size(self, field: str, sequences: int, tokens: int) -> None:
        """Refuse (413) a request of more sequences or token positions than the limits."""
        if sequences > self.limits.max_prompts:
            raise over(field, "sequences", sequences, "max_prompts", self.limits.max_prompts)
        if tokens > self.limits.max_tokens:
            raise over(field, "token positions", tokens, "max_tokens", self.limits.max_tokens)


@dataclasses.dataclass
class Session:
    """One client's session (module docstring). ``lora`` and ``seed`` are what it was created with;
    ``trained_bytes``: what its optimizer steps (adapters, a value head; rank 0: the model)."""

    id: str
    lora: LoRAConfig
    seed: int
    state: (
        TrainState | None
    )  # None: the holder of base-model sampling draws (Service._base_session)
    bounds: Bounds
    value_head: bool = (
        False  # state.critic is a ValueHead on the policy's backbone (objective "ppo")
    )
    trained_bytes: int = 0
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
        bounds: Bounds,
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
        size = memory.tree_bytes((split_trainable(policy)[0], critic))
        return cls(sid, lora, seed, state, bounds, value_head, size)

    @property
    def config(self):
        return self.state.policy.config

    def _itemsize(self, policy) -> int:
        return np.dtype(policy.dtype).itemsize

    # ------------------------------------------------------------------ forward_backward

    def _check_tokens(self, batch) -> None:
        for name in _TOKEN_FIELDS:
            a = getattr(batch, name, None)
            if a is not None and a.size and (a.min() < 0 or a.max() >= self.config.vocab_size):
                raise RequestError(
                    f"batch.{name}", f"token ids must be in [0, {self.config.vocab_size})"
                )

    def _measure(self, field: str, sequences: int, length: int, what: str) -> None:
        """Refuse a forward(_backward) over the limits, or whose floor does not fit in memory."""
        self.bounds.size(field, sequences, sequences * length)
        need = memory.fb_bytes(
            self.config, sequences, length, self.trained_bytes, self._itemsize(self.state.policy)
        )
        self.bounds.fits(field, need, f"{what} (at least, by relax.serve.memory's floor)")

    def _datum_loss(self, request: dict, loss: str, config: dict, backward: bool):
        config = tinker_options(config)
        statics, numbers = loss_options(config)
        datum_loss(loss, config)  # the name and options, checked before anything is built
        mesh = mesh_of(self.state)
        lengths = datum_lengths(
            request["data"], loss, self.config.vocab_size, self.config.max_position_embeddings
        )
        shape = row_shape(lengths, shards(mesh))
        what = "forward_backward" if backward else "forward"
        self._measure("data", *shape, what)
        rows = place_rows(pack_rows(request["data"], lengths, loss, shape), mesh, "data")
        step = steps.datum_step(loss, statics, backward)
        grads, metrics, logp, finite = self.bounds.run(
            "data", what, ("datum", loss, statics, backward), step, numbers, self.state, rows
        )
        logp = np.asarray(logp)  # one copy to host, then sliced per datum
        return grads, metrics, finite, [{"logprobs": logp[i, :n]} for i, n in enumerate(lengths)]

    def _objective_loss(self, request: dict, loss: str, config: dict, backward: bool):
        batch = decode_batch(request["batch"], "batch")
        self._check_tokens(batch)
        if loss not in objectives.OBJECTIVES:
            raise RequestError(
                "loss_fn",
                f"unknown objective {loss!r}; valid: {', '.join(sorted(objectives.OBJECTIVES))}",
            )
        if loss in NOT_SERVED:
            raise RequestError("loss_fn", NOT_SERVED[loss])
        sequences, length, field = batch_extent(batch)
        if length > self.config.max_position_embeddings:
            raise RequestError(
                field,
                f"{length} positions per sequence (prompt plus completion, or a packed row) is "
                f"more than the model's {self.config.max_position_embeddings}",
            )
        statics, numbers = loss_options(config)
        what = "forward_backward" if backward else "forward"
        self._measure("batch", sequences, length, what)
        batch = place_rows(batch, mesh_of(self.state), "batch")
        step = steps.objective_step(loss, statics, backward)
        try:
            grads, metrics, finite = self.bounds.run(
                "batch",
                what,
                ("objective", loss, statics, backward),
                step,
                numbers,
                self.state,
                batch,
            )
        except RequestError:
            raise
        except (TypeError, ValueError) as e:  # the objective's own checks, at trace time
            raise RequestError("loss_fn_config" if config else "batch", str(e)) from None
        return grads, metrics, finite, []

    def forward_backward(self, request: dict, *, backward: bool = True) -> tuple[dict, list]:
        """The loss's metrics and per-datum outputs; with ``backward`` its gradients are added to
        ``pending``. A non-finite loss, gradient or sum is refused: nothing is added."""
        loss, config = request.get("loss_fn"), request.get("loss_fn_config")
        config = {} if config is None else config
        if not isinstance(loss, str):
            raise RequestError("loss_fn", "the loss's name (a string) is needed")
        if not isinstance(config, dict):
            raise RequestError("loss_fn_config", "a map of the loss's options is needed")
        if ("data" in request) == ("batch" in request):
            raise RequestError(
                "data", "send either data (a list of datums) or batch (a typed batch)"
            )
        where = "data" if "data" in request else "batch"
        run = self._datum_loss if where == "data" else self._objective_loss
        grads, metrics, finite, outputs = run(request, loss, config, backward)
        metrics = {k: float(v) for k, v in metrics.items()}
        if backward:
            if not bool(finite):
                raise RequestError(
                    where,
                    f"the loss or its gradients are not finite (loss {metrics['loss']}); "
                    "nothing was accumulated",
                )
            if self.pending is not None:
                grads, finite = self.bounds.run(
                    where,
                    "the sum of gradients",
                    ("accumulate",),
                    steps.accumulate,
                    {},
                    self.pending,
                    grads,
                )
                if not bool(finite):
                    raise RequestError(
                        where,
                        "the gradients summed with those pending overflow float32; nothing was "
                        "accumulated (call optim_step to use the pending ones)",
                    )
            self.pending = grads
        return metrics, outputs

    # ------------------------------------------------------------------ optimizer, sampling

    def optim_step(self, adam_params: Any) -> dict:
        """One step on the accumulated gradients with ``adam_params``; clears them. A step whose
        new weights or moments are not finite is refused: the session is as it was."""
        hyper = adam_hyperparams(
            {} if adam_params is None else adam_params, self.bounds.limits.max_learning_rate
        )
        if self.pending is None:
            raise RequestError(
                "optim_step", "no gradients accumulated since the last step: call forward_backward"
            )
        state, norm, finite = self.bounds.run(
            "adam_params", "optim_step", ("optim",), steps.optim, hyper, self.state, self.pending
        )
        if not bool(finite):
            raise RequestError(
                "adam_params",
                f"this step would make the weights or the optimizer's moments non-finite "
                f"(gradient norm {float(norm):g}); the session is unchanged, its gradients still "
                "pending: step with a smaller learning_rate or a max_grad_norm",
                status=422,
            )
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

    def _prompts(self, policy, request: dict) -> tuple[list, int, dict]:
        """The checked prompts, ``num_samples`` and sampling options of a sample request."""
        prompts, n = request.get("prompts"), request.get("num_samples", 1)
        limits, config = self.bounds.limits, policy.config
        if not isinstance(prompts, list) or not prompts:
            raise RequestError("prompts", "a non-empty list of token arrays is needed")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError("num_samples", f"must be an integer >= 1, got {n!r}")
        if n > limits.max_samples:
            raise over("num_samples", "num_samples", n, "max_samples", limits.max_samples)
        if len(prompts) > limits.max_prompts:
            raise over("prompts", "prompts", len(prompts), "max_prompts", limits.max_prompts)
        opts = sampling_options(
            request.get("sampling_params"), config.vocab_size, config.max_position_embeddings
        )
        ok = all(isinstance(p, np.ndarray) and p.ndim == 1 and p.size for p in prompts)
        lp = max(len(p) for p in prompts) if ok else 0
        if lp == 0 or lp + opts["max_tokens"] > config.max_position_embeddings:
            raise RequestError(
                "prompts",
                f"each prompt must be a non-empty 1-D token array, prompt plus max_tokens "
                f"at most {config.max_position_embeddings} positions",
            )
        for i, p in enumerate(prompts):
            if p.dtype.kind not in "iu" or p.min() < 0 or p.max() >= config.vocab_size:
                raise RequestError(
                    f"prompts[{i}]", f"token ids must be integers in [0, {config.vocab_size})"
                )
        return prompts, n, opts

    def sample(self, policy, request: dict) -> list[dict]:
        """``num_samples`` completions of each of ``request["prompts"]`` by ``policy``."""
        prompts, n, opts = self._prompts(policy, request)
        config, p, new = policy.config, len(prompts), opts["max_tokens"]
        cfg = RolloutConfig(
            num_generations=n,
            max_new_tokens=new,
            sampling=SamplingConfig(opts["temperature"], opts["top_k"], opts["top_p"]),
            eos_ids=tuple(sorted({*config.eos_ids, *opts["stop"]})),
            pad_id=0,
        )
        try:
            lp = bucket_length(max(len(x) for x in prompts), cfg.prompt_buckets)
        except ValueError as e:
            raise RequestError("prompts", str(e)) from None
        self.bounds.size("prompts", p * n, p * n * (lp + new))
        need = memory.sample_bytes(
            config, memory.tree_bytes(policy), p, lp, n, new, self._itemsize(policy)
        )
        self.bounds.fits("prompts", need, "sample (at least, by relax.serve.memory's floor)")
        ids, mask = np.zeros((p, lp), np.int32), np.zeros((p, lp), np.int32)
        for i, x in enumerate(prompts):
            ids[i, lp - len(x) :], mask[i, lp - len(x) :] = x, 1
        try:
            validate(policy, ids, mask, cfg)
        except ValueError as e:
            raise RequestError("prompts", str(e)) from None
        key = self._key(opts["seed"])  # after every check: a refused request draws nothing
        placed = place_rows({"prompt_ids": ids, "prompt_mask": mask}, mesh_of(policy), None)
        numbers = {k: opts[k] for k in ("temperature", "top_p") if opts[k] is not None}
        step = steps.sample_step(n, new, opts["top_k"], cfg.eos_ids)
        r = self.bounds.run(
            "prompts",
            "sample",
            ("sample", n, new, opts["top_k"], cfg.eos_ids),
            step,
            numbers,
            policy,
            placed["prompt_ids"],
            placed["prompt_mask"],
            key,
        )
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
            for i in range(p)
        ]

    def _key(self, seed: int | None) -> jax.Array:
        if seed is not None:
            return jax.random.key(seed)
        return jax.random.fold_in(
            jax.random.fold_in(jax.random.key(self.seed), 2), next(self.draws)
        )
