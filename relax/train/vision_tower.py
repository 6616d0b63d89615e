"""A vision-language policy's trained vision tower in an update (``--train-vision``).

The state holds the tower (``TrainState.vision``) and the policy's optimizer trains
``(policy, vision)``. A batch that carries its images (``Pixels``) beside its image prompts'
inputs (made by the initial tower) has the inputs' features recomputed by the tower being
trained once per optimizer step, inside the gradient: ``image_side(field)`` is
``relax.train.update.make_update``'s ``side`` for a batch whose ``PromptInputs`` are at
``field``, ``ImageData`` its ``side_data``. The tower runs once per image, not per row of a
micro-batch or per completion.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool

from relax.models.adapters.operations import split_trainable
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.vision.families import Pixels, with_image_features
from relax.train.state import TrainState, trained_params
from relax.train.update import SideInputs

__all__ = [
    "ImageData",
    "image_side",
    "initial_features_read",
    "tower_is_initial",
    "with_trained_vision",
]


class ImageData(NamedTuple):
    """What the update's tower reads: the batch's image prompts' inputs (their image tokens and
    the features' dtype) and their images (None: no image in the batch)."""

    inputs: PromptInputs
    pixels: Pixels | None


def image_side(field: str) -> SideInputs:
    """The side inputs of a batch whose ``PromptInputs`` are its ``field``: the features of
    ``ImageData`` by the trained tower, placed in each micro-batch's ``field``."""

    def encode(vision, data: ImageData):
        return with_image_features(data.inputs, vision, data.pixels).features

    def place(micro_batch, features):
        inputs = getattr(micro_batch, field)._replace(features=features)
        return dataclasses.replace(micro_batch, **{field: inputs})

    return SideInputs(encode=encode, place=place)


def with_trained_vision(state: TrainState, vision) -> TrainState:
    """``state`` training ``vision`` with its policy: the optimizer's state made anew over
    ``(policy, vision)``'s trainable leaves (a fresh state: no step taken yet)."""
    params = trained_params(state.policy, vision)
    opt_state: optax.OptState = state.optimizer.init(split_trainable(params)[0])
    return state.replace(vision=vision, opt_state=opt_state)


def tower_is_initial(state: TrainState) -> Bool[Array, ""]:
    """Whether the state's tower is bitwise the initial one, which made the batch's image inputs
    (no trained tower, or no update yet): only then can a reference's log-probs be the policy's."""
    return jnp.bool_(True) if state.vision is None else state.step == 0


def initial_features_read(state: TrainState) -> bool:
    """Whether a model besides the policy reads the initial tower's features (the batch's
    ``PromptInputs`` as the data encodes them): a reference (its own or a LoRA policy's base) or
    a separate critic. When none does and the tower trains, the data need not run the tower."""
    return state.ref is not None or state.ref_is_base or state.critic is not None
