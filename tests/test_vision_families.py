"""Vision-language directories by ``config.json``: ``load_vision_language`` reads both families
written by transformers into their language model and vision part (the same logits as the
family's own loader), saves them back, and the text loader refuses them with a pointer."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_vision_gemma3 import IMAGE_ROWS, _batch, _hf_model, _pixels  # noqa: E402
from test_vision_qwen2_5_vl import _config, _prompts  # noqa: E402
from test_vision_qwen2_5_vl import _pixels as _qwen_pixels  # noqa: E402

from relax.models.hf.checkpoint import load_pretrained  # noqa: E402
from relax.models.hf.config import HFFormatError  # noqa: E402
from relax.models.vision.families import (  # noqa: E402
    load_vision_language,
    save_vision_language,
    vision_family_of,
)
from relax.models.vision.gemma3 import vlm_logits  # noqa: E402
from relax.models.vision.qwen2_5_vl import vl_forward  # noqa: E402

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    _hf_model().save_pretrained(root / "gemma3")
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(_config()).save_pretrained(root / "qwen")
    return root


def _gemma_logits(lm, vision):
    ids, mask = _batch()
    pix = _pixels(3).numpy()
    return np.asarray(vlm_logits(lm, vision, ids, mask, pix, np.asarray(IMAGE_ROWS)))


def _qwen_logits(lm, vision):
    ids, mask, grids = _prompts()
    model = dataclasses.replace(vision, language_model=lm)
    return np.asarray(vl_forward(model, ids, mask, _qwen_pixels(grids), grids))


def test_both_families_load_and_save_by_config(dirs, tmp_path):
    g = load_vision_language(dirs / "gemma3")
    assert g.family.model_type == "gemma3" and g.language_model.config.family == "gemma3_text"
    q = load_vision_language(dirs / "qwen")
    assert q.family.model_type == "qwen2_5_vl" and q.language_model.config.family == "qwen2"
    for vl, logits in (
        (g, lambda m: _gemma_logits(m.language_model, m.vision)),
        (q, lambda m: _qwen_logits(m.language_model, m.vision)),
    ):
        out = tmp_path / vl.family.model_type
        save_vision_language(vl, out)
        assert vision_family_of(out) is vl.family
        again = load_vision_language(out)
        np.testing.assert_array_equal(logits(again), logits(vl))
        back = getattr(transformers, vl.family.architecture).from_pretrained(out)
        assert type(back).__name__ == vl.family.architecture


def test_the_text_loader_points_to_the_vision_loader(dirs):
    for name in ("gemma3", "qwen"):
        with pytest.raises(HFFormatError, match="vision-language model: load it with"):
            load_pretrained(dirs / name)


def test_a_text_model_is_not_a_vision_language_one(tmp_path):
    import jax

    from relax.models import family_config, init
    from relax.models.hf.checkpoint import save_pretrained

    cfg = family_config(
        "llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=32,
    )
    save_pretrained(init(cfg, jax.random.key(0)), tmp_path / "text")
    assert vision_family_of(tmp_path / "text") is None
    with pytest.raises(HFFormatError, match="not a vision-language model"):
        load_vision_language(tmp_path / "text")


def test_gemma3_encode_counts_the_image_tokens(dirs):
    """The run's encode refuses a batch whose image tokens are not its images x
    mm_tokens_per_image (the features would land on the wrong tokens), and takes the right one."""
    from relax.data.image_prompts import ImageBatch
    from relax.models.vision.families import encode_images

    vl = load_vision_language(dirs / "gemma3")
    ids, mask = _batch()
    pix = _pixels(3).numpy()
    inputs = encode_images(vl, vl.language_model, ids, mask, ImageBatch(pix, ()))
    assert int(np.asarray(inputs.is_image).sum()) == 3 * vl.vision.config.mm_tokens_per_image
    with pytest.raises(ValueError, match="expected 2 image"):
        encode_images(vl, vl.language_model, ids, mask, ImageBatch(pix[:2], ()))
