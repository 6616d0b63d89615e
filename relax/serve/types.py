"""The training service's request and response types, named as Tinker's (``tinker.types``).

    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                  loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": sampler_logprobs,
                                  "advantages": advantages})
    client.forward_backward([datum], "importance_sampling").result().metrics

A ``Datum`` is one sequence: ``model_input`` the tokens the model reads, ``loss_fn_inputs`` arrays
of the same length: ``target_tokens`` (the token predicted at each position) and what the loss
reads (``weights`` for ``cross_entropy``; ``logprobs``, the sampler's, and ``advantages`` for the
policy losses). Plain dataclasses of numpy arrays and ints: they travel as msgpack maps
(``relax.serve.wire``), never pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = [
    "AdamParams",
    "Datum",
    "ForwardBackwardOutput",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SaveResponse",
    "SampledSequence",
    "SamplingParams",
    "TensorData",
]


@dataclasses.dataclass(frozen=True)
class ModelInput:
    """The tokens a model reads (Tinker's ``ModelInput`` with one chunk of token ids)."""

    tokens: tuple[int, ...]

    @classmethod
    def from_ints(cls, tokens) -> ModelInput:
        return cls(tuple(int(t) for t in tokens))

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class TensorData:
    """An array in a ``Datum``'s ``loss_fn_inputs`` (numpy arrays and lists are taken as they are)."""

    data: np.ndarray

    @classmethod
    def from_numpy(cls, a) -> TensorData:
        return cls(np.asarray(a))

    def to_numpy(self) -> np.ndarray:
        return np.asarray(self.data)

    def tolist(self) -> list:
        return np.asarray(self.data).tolist()


@dataclasses.dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, Any]

    def to_wire(self) -> dict:
        inputs = {
            k: np.asarray(v.data if isinstance(v, TensorData) else v)
            for k, v in self.loss_fn_inputs.items()
        }
        return {"tokens": np.asarray(self.model_input.tokens, np.int32), "inputs": inputs}


@dataclasses.dataclass(frozen=True)
class AdamParams:
    """The optimizer step's hyperparameters (Tinker's defaults); ``max_grad_norm`` (relax's
    addition) clips the global gradient norm first (None: no clipping). The service checks each
    in float32 (``relax.serve.options``: ``learning_rate`` in ``(0, --limits.max-learning-rate]``,
    betas below 1, ``eps`` > 0, ``learning_rate * weight_decay < 1``) and refuses a step whose
    result would not be finite (422), the session unchanged."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    max_grad_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``max_tokens`` new tokens at ``temperature`` (``top_k=-1`` / ``top_p=1``: off), stopping at
    the model's end-of-sequence tokens and the ``stop`` token ids; ``seed`` (in ``[0, 2**32)``)
    fixes the draw (None: the session's next key). ``temperature`` and ``top_p`` are arguments of
    the compiled sampler: new values compile nothing."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: tuple[int, ...] | None = None
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop token, included in tokens) or "length"


@dataclasses.dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]


@dataclasses.dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per datum, its outputs (``logprobs`` of its target tokens); the loss's metrics."""

    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class SaveResponse:
    """Where ``save_state`` / ``save_weights`` / ``save_weights_for_sampler`` put it (``path``)."""

    path: str
