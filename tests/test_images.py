"""relax.data.images against transformers 5.23's PIL image processors and processors.

Pixels and grids are compared exactly with ``Gemma3ImageProcessorPil`` / ``Qwen2VLImageProcessorPil``
on images drawn here (noise and shapes; RGB of several sizes, grayscale, RGBA, palette with
transparency); prompt expansion by the token ids ``Gemma3Processor`` / ``Qwen2_5_VLProcessor``
give, with a tiny word-level tokenizer built here; decoding against ``transformers.image_utils
.load_image``; every decode failure is an ``ImageError`` naming its source.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("transformers")  # the parity extra; every test here compares against it

from PIL import Image, ImageDraw  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.image_utils import load_image  # noqa: E402
from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor  # noqa: E402
from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor  # noqa: E402
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from relax.data.files import Record  # noqa: E402
from relax.data.images import (  # noqa: E402
    Gemma3ImageConfig,
    Gemma3ImageProcessor,
    ImageError,
    ImageLimits,
    PanAndScan,
    Qwen2VLImageConfig,
    Qwen2VLImageProcessor,
    decode_image,
    record_images,
)
from relax.data.images.decode import is_base64  # noqa: E402
from relax.data.images.pixels import PixelSteps  # noqa: E402
from relax.models.hf.reader import HFFormatError  # noqa: E402


def drawn(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise with an ellipse, a rectangle and a line on it, in ``mode``."""
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    d = ImageDraw.Draw(im)
    d.ellipse((w // 5, h // 6, w * 3 // 4, h * 5 // 6), fill=(250, 30, 20, 200))
    d.rectangle((w // 2, h // 3, w - 2, h - 3), fill=(10, 200, 90, 60))
    d.line((0, h - 1, w - 1, 0), fill=(0, 0, 255, 255), width=3)
    if mode == "P":
        p = im.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
        p.info["transparency"] = 3
        return p
    return im if mode == "RGBA" else im.convert(mode)


IMAGES = {
    "rgb_37x53": drawn(37, 53, seed=1),
    "rgb_224x160": drawn(224, 160, seed=2),
    "rgb_640x480": drawn(640, 480, seed=3),
    "gray_90x70": drawn(90, 70, "L", seed=4),
    "rgba_120x45": drawn(120, 45, "RGBA", seed=5),
    "palette_64x64": drawn(64, 64, "P", seed=6),
}
WIDE = drawn(300, 70, seed=7)  # elongated enough for pan-and-scan


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------- tokenizers

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?\n")


def tokenizer(**special) -> PreTrainedTokenizerFast:
    """Character-level word tokenizer: every character a token, specials atomic."""
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", *CHARS])}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special)


GEMMA_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
QWEN_SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


class QwenProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without its video processor (it needs torchvision, absent here);
    images only, so the class check of the missing video processor is skipped."""

    def check_argument_for_proper_class(self, name, arg):
        return None


# ------------------------------------------------------------------------------- Gemma 3


@pytest.mark.parametrize("name", list(IMAGES))
@pytest.mark.parametrize("size", [(224, 224), (48, 80)])
def test_gemma3_pixels_equal_transformers(name, size):
    im = IMAGES[name]
    ref = Gemma3ImageProcessorPil(size={"height": size[0], "width": size[1]})(im)["pixel_values"]
    config = Gemma3ImageConfig(height=size[0], width=size[1])
    ours = Gemma3ImageProcessor(config)([im])
    assert ours.pixel_values.shape == (1, 3, *size) and ours.num_crops == (0,)
    np.testing.assert_array_equal(ours.pixel_values[0], ref[0])


def gemma_processor(size=(32, 40), seq=3, **image_kwargs) -> Gemma3Processor:
    ip = Gemma3ImageProcessorPil(size={"height": size[0], "width": size[1]}, **image_kwargs)
    return Gemma3Processor(
        image_processor=ip,
        tokenizer=tokenizer(**{"extra_special_tokens": GEMMA_TOKENS}),
        image_seq_length=seq,
    )


PROMPTS = {
    0: "hello there, no image.",
    1: "look<start_of_image>what is it?",
    2: "one <start_of_image> and two<start_of_image>",
}


def _gemma_images(n):
    return [IMAGES["rgb_37x53"], IMAGES["rgba_120x45"]][:n]


@pytest.mark.parametrize("n", [0, 1, 2])
def test_gemma3_processor_from_dir_equals_transformers(tmp_path, n):
    """Saved by ``Gemma3Processor.save_pretrained`` (nested processor_config.json), read back by
    relax; the same pixels and, tokenized, the same input ids."""
    proc = gemma_processor(resample=3, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.25])
    proc.save_pretrained(tmp_path)
    config = Gemma3ImageConfig.from_dir(tmp_path)
    assert (config.height, config.width, config.image_seq_length) == (32, 40, 3)
    assert config.steps == PixelSteps(3, (0.4, 0.5, 0.6), (0.2, 0.3, 0.25))
    ours = Gemma3ImageProcessor(config)
    images = _gemma_images(n)
    ref = proc(text=[PROMPTS[n]], images=[images] if n else None)
    got = ours(images)
    assert got.num_crops == (0,) * n
    if n:
        np.testing.assert_array_equal(got.pixel_values, np.stack(ref["pixel_values"]))
    text = ours.expand_prompt(PROMPTS[n], got.num_crops)
    assert text.count("<image_soft_token>") == 3 * n
    assert proc.tokenizer(text)["input_ids"] == ref["input_ids"][0]


def test_gemma3_pan_and_scan_equals_transformers():
    proc = gemma_processor()
    images = [WIDE, IMAGES["rgb_37x53"], WIDE.transpose(Image.Transpose.ROTATE_90)]
    text = "a<start_of_image>b<start_of_image>c<start_of_image>"
    ref = proc(text=[text], images=[images], do_pan_and_scan=True, pan_and_scan_min_crop_size=32)
    ours = Gemma3ImageProcessor(
        Gemma3ImageConfig(32, 40, image_seq_length=3, pan_and_scan=PanAndScan(32))
    )
    got = ours(images)
    assert got.num_crops == (4, 0, 4)  # 300/70 rounds to 4, within max_num_crops
    np.testing.assert_array_equal(got.pixel_values, np.stack(ref["pixel_values"]))
    expanded = ours.expand_prompt(text, got.num_crops)
    assert proc.tokenizer(expanded)["input_ids"] == ref["input_ids"][0]


def test_gemma3_hub_layout_and_defaults(tmp_path):
    """The hub's flat preprocessor_config.json (nulls for pan-and-scan) plus processor_config.json
    with image_seq_length; tokens from tokenizer_config.json."""
    hub = {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": 256,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 56, "width": 56},
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(hub))
    (tmp_path / "processor_config.json").write_text('{"image_seq_length": 7}')
    (tmp_path / "tokenizer_config.json").write_text('{"boi_token": "<boi>"}')
    config = Gemma3ImageConfig.from_dir(tmp_path)
    assert config == Gemma3ImageConfig(56, 56, image_seq_length=7, boi_token="<boi>")
    ref = Gemma3ImageProcessorPil.from_pretrained(tmp_path)(IMAGES["rgb_640x480"])
    got = Gemma3ImageProcessor(config)([IMAGES["rgb_640x480"]])
    np.testing.assert_array_equal(got.pixel_values[0], ref["pixel_values"][0])


def test_config_errors_name_file_and_field(tmp_path):
    with pytest.raises(HFFormatError, match="no image processor config"):
        Gemma3ImageConfig.from_dir(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    path.write_text('{"size": {"shortest_edge": 10}}')
    with pytest.raises(HFFormatError, match=r"preprocessor_config.json: field 'size'"):
        Gemma3ImageConfig.from_dir(tmp_path)
    path.write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    with pytest.raises(HFFormatError, match="image_processor_type"):
        Gemma3ImageConfig.from_dir(tmp_path)
    path.write_text('{"image_std": [0.5, 0, 0.5]}')
    with pytest.raises(HFFormatError, match="image_std"):
        Qwen2VLImageConfig.from_dir(tmp_path)
    path.write_text('{"size": {"shortest_edge": 10}}')
    with pytest.raises(HFFormatError, match=r"size.longest_edge"):
        Qwen2VLImageConfig.from_dir(tmp_path)


# ------------------------------------------------------------------------------- Qwen2-VL

QWEN_SETTINGS = {
    "default": {},
    "small_max": {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16},
    "large_min": {"min_pixels": 28 * 28 * 130, "max_pixels": 28 * 28 * 400},
    "patch8": {"min_pixels": 16 * 16, "max_pixels": 16 * 16 * 40, "patch_size": 8},
}


def qwen_config(setting: dict) -> Qwen2VLImageConfig:
    return Qwen2VLImageConfig(**{k: v for k, v in setting.items()})


@pytest.mark.parametrize("setting", list(QWEN_SETTINGS))
def test_qwen_pixels_and_grid_equal_transformers(setting):
    kw = QWEN_SETTINGS[setting]
    images = list(IMAGES.values())
    ref = Qwen2VLImageProcessorPil(**kw)(images)
    got = Qwen2VLImageProcessor(qwen_config(kw))(images)
    np.testing.assert_array_equal(got.image_grid_thw, ref["image_grid_thw"])
    assert got.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"])


def test_qwen_settings_change_the_grid():
    """The settings above exercise both branches of smart_resize (so the tests could fail)."""
    im = [IMAGES["rgb_640x480"], IMAGES["rgb_37x53"]]
    grids = {
        s: tuple(map(tuple, Qwen2VLImageProcessor(qwen_config(kw))(im).image_grid_thw.tolist()))
        for s, kw in QWEN_SETTINGS.items()
    }
    # 480x640 rounds to 476x644; 53x37 rounds to 56x28 < 56*56, scaled up to 84x56
    assert grids["default"] == ((1, 34, 46), (1, 6, 4))
    assert grids["small_max"][0] == (1, 6, 8)  # scaled down to <= 16 merge blocks
    assert grids["large_min"][1] == (1, 28, 20)  # scaled up to >= 130 merge blocks
    assert grids["patch8"][0] == (1, 10, 14)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_qwen_prompt_expansion_equals_transformers(n):
    kw = QWEN_SETTINGS["small_max"]
    tok = tokenizer(additional_special_tokens=QWEN_SPECIALS)
    proc = QwenProcessor(image_processor=Qwen2VLImageProcessorPil(**kw), tokenizer=tok)
    texts = {
        0: "no images here.",
        1: "see <|vision_start|><|image_pad|><|vision_end|>now",
        2: "<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|><|vision_end|>",
    }
    images = [IMAGES["rgb_640x480"], IMAGES["gray_90x70"]][:n]
    ref = proc(text=[texts[n]], images=images or None)
    ours = Qwen2VLImageProcessor(qwen_config(kw))
    got = ours(images)
    if n:
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"])
        np.testing.assert_array_equal(got.image_grid_thw, ref["image_grid_thw"])
    text = ours.expand_prompt(texts[n], got.image_grid_thw)
    assert tok(text)["input_ids"] == ref["input_ids"][0]
    counts = ours.num_tokens(got.image_grid_thw)
    assert text.count("<|image_pad|>") == sum(counts) and len(counts) == n
    with pytest.raises(ValueError, match="placeholders"):
        ours.expand_prompt(texts[n] + "<|image_pad|>", got.image_grid_thw)


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_qwen_config_from_dir_equals_transformers(tmp_path, layout):
    if layout == "hub":  # Qwen2.5-VL's file: top-level min/max pixels, no size
        hub = {
            "min_pixels": 28 * 28 * 8,
            "max_pixels": 28 * 28 * 20,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        }
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(hub))
    else:
        Qwen2VLImageProcessorPil(
            min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 20, resample=2, temporal_patch_size=3
        ).save_pretrained(tmp_path)
    config = Qwen2VLImageConfig.from_dir(tmp_path)
    assert (config.min_pixels, config.max_pixels) == (28 * 28 * 8, 28 * 28 * 20)
    ref_proc = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    images = [IMAGES["rgb_224x160"], IMAGES["rgba_120x45"]]
    ref, got = ref_proc(images), Qwen2VLImageProcessor(config)(images)
    np.testing.assert_array_equal(got.image_grid_thw, ref["image_grid_thw"])
    np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"])


# ------------------------------------------------------------------------------- decoding


def test_path_bytes_and_base64_decode_alike(tmp_path):
    """Every form of the same PNG decodes to one array, load_image's (alpha dropped)."""
    data = png(IMAGES["rgba_120x45"])
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    rows = [
        "img/a.png",
        data,
        b64,
        "data:image/png;base64," + b64,
        {"bytes": None, "path": "img/a.png"},
        {"bytes": data, "path": "ignored.png"},
    ]
    rec = Record(str(tmp_path / "data.jsonl"), 1, {"images": rows})
    arrays = record_images(rec, "images")
    ref = np.asarray(load_image(str(tmp_path / "img" / "a.png")))
    assert ref.shape == (45, 120, 3)
    for a in arrays:
        np.testing.assert_array_equal(a, ref)


def test_exif_orientation_like_load_image(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    buf = io.BytesIO()
    IMAGES["rgb_37x53"].save(buf, "JPEG", exif=exif)
    (tmp_path / "r.jpg").write_bytes(buf.getvalue())
    got = decode_image(buf.getvalue())
    ref = np.asarray(load_image(str(tmp_path / "r.jpg")))
    assert got.shape == (37, 53, 3)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", ["gray_90x70", "rgba_120x45", "palette_64x64", "keyed_rgb"])
def test_decoded_images_feed_the_processors_like_load_image(tmp_path, name):
    """A file decoded by relax, then processed, equals transformers' processors given the path
    (``load_image``, then their RGB conversion): a palette or RGB PNG with a transparent colour
    (tRNS) has those pixels composited onto white, an alpha channel is dropped."""
    im = IMAGES["rgb_37x53"].copy() if name == "keyed_rgb" else IMAGES[name]
    if name == "keyed_rgb":
        im.info["transparency"] = tuple(int(v) for v in np.asarray(im)[5, 7])
    path = str(tmp_path / "g.png")
    (tmp_path / "g.png").write_bytes(png(im))
    got = Gemma3ImageProcessor()([decode_image(path)]).pixel_values
    ref = Gemma3ImageProcessorPil()(path)["pixel_values"]
    np.testing.assert_array_equal(got[0], ref[0])
    got = Qwen2VLImageProcessor()([decode_image(path)]).pixel_values
    np.testing.assert_array_equal(got, Qwen2VLImageProcessorPil()(path)["pixel_values"])


def _fails(value, match, *, limits=None, tmp_path=None):
    rec = Record(str(tmp_path / "rows.jsonl") if tmp_path else "rows.jsonl", 7, {"pic": value})
    with pytest.raises(ImageError, match=match) as e:
        record_images(rec, "pic", limits=limits or ImageLimits())
    assert "rows.jsonl row 7, field 'pic'" in str(e.value)
    return str(e.value)


def test_decode_failures_name_the_source(tmp_path):
    data = png(IMAGES["rgb_37x53"])
    msg = _fails("nope/missing.png", r"image \(path '.*missing.png'\)", tmp_path=tmp_path)
    assert "No such file" in msg
    _fails(data[: len(data) // 2], r"image \(bytes\): unreadable image data")
    _fails(b"just some text, not a picture", r"image \(bytes\): not an image")
    _fails("data:image/png;base64,iVBOR!!w0KGgo=", r"image \(base64\): not valid base64")
    _fails("data:text/plain;base64,aGk=", r"image \(base64\): a data URI must start")
    _fails("A" * 5000 + "!", r"image \(base64\): not valid base64")
    _fails(
        data, r"37x53 = 1961 pixels, over the limit of 1000", limits=ImageLimits(max_pixels=1000)
    )
    (tmp_path / "big.png").write_bytes(data)
    msg = _fails(
        "big.png",
        r"image \(path .*big.png'\): the file is",
        tmp_path=tmp_path,
        limits=ImageLimits(max_bytes=100),
    )
    assert f"{len(data)} bytes, over the limit of 100 bytes" in msg
    _fails(
        base64.b64encode(data).decode(),
        r"image \(base64\): .*over",
        limits=ImageLimits(max_bytes=100),
    )
    _fails(12, r"expected a path, bytes or a base64 string, got int")
    rec = Record("rows.jsonl", 7, {})
    with pytest.raises(
        ImageError, match="rows.jsonl row 7, field 'pic': the row has no such field"
    ):
        record_images(rec, "pic")


def test_pillow_bomb_error_is_an_image_error(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)  # Pillow raises over twice this
    with pytest.raises(ImageError, match="over Pillow's pixel limit"):
        decode_image(png(IMAGES["rgb_37x53"]), where="x")


def test_base64_or_path():
    b64 = base64.b64encode(png(IMAGES["rgb_37x53"])).decode()
    assert is_base64(b64) and is_base64("data:image/png;base64,xx")
    assert not is_base64("images/cat.png") and not is_base64("abcd")
