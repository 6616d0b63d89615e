"""A trained vision tower in an online step (``--train-vision``).

The state holds the tower (``TrainState.vision``) and the policy's optimizer trains it with the
language model. The batch carries the images (``Prompts.pixels``) beside the image prompts'
inputs the data made with the initial tower (``Prompts.images``: the reference's features), and:

- the sampler and the proximal forward read the state's tower's features (``policy_images``),
  computed once per image;
- the update recomputes them from the tower being trained once per optimizer step, inside the
  gradient (``IMAGE_FEATURES``: ``relax.train.vision_tower.image_side``), so the tower's gradient is
  the whole minibatch's and it still runs once per image, not per completion;
- the reference reads ``Prompts.images``: the reference model is the initial language model
  with the initial tower.
"""

from __future__ import annotations

from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.vision.families import with_image_features
from relax.train.state import TrainState
from relax.train.vision_tower import ImageData, image_side

__all__ = [
    "IMAGE_FEATURES",
    "image_data",
    "policy_images",
]


IMAGE_FEATURES = image_side("images")  # the update's side inputs: the batch's ``images``


def image_data(batch) -> ImageData | None:
    """The update's side data of a batch whose policy trains its tower (None: no image)."""
    return None if batch.images is None else ImageData(batch.images, batch.pixels)


def policy_images(state: TrainState, batch) -> PromptInputs | None:
    """The batch's image prompts' inputs for the state's policy: with the state's tower's
    features when it trains one, else the batch's own."""
    if state.vision is None or batch.images is None:
        return batch.images
    return with_image_features(batch.images, state.vision, batch.pixels)
