"""A built-in visual task: count the shapes in a small picture.

Each image is ``image_size`` pixels square, a plain ``background`` with 1..``max_count`` filled
shapes (squares, discs, triangles) in distinct colours, drawn by Pillow without anti-aliasing and
kept ``gap`` pixels apart (so the shapes are exactly the connected non-background regions). The
prompt is ``"How many shapes are in the image?"``, the answer the count as a digit string, the
reward exact match. Records carry the image as a base64 PNG string (``relax.data.images
.decode_image`` reads it). Train and held-out images come from separate seed streams of ``seed``;
a held-out image identical to a training one is skipped, so the splits share no image. A tiny
Qwen2.5-VL for it is ``relax.tasks.tiny_vlm.write_tiny_qwen2_5_vl``. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["SHAPES", "VisualTask", "draw", "encode_png", "make_splits"]

SHAPES = ("square", "disc", "triangle")
RGB = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class VisualTask:
    """The pictures (size, counts, shapes, colours), the splits, and the base model
    (``relax.tasks.visual_base``): its teacher, its sizes and its supervised phase.

    ``min_size`` / ``max_size``: a shape's bounding-box side in pixels; ``gap``: the least
    distance in pixels between two bounding boxes (and from a box to the image's edge, 1)."""

    image_size: int = 56
    max_count: int = 4
    shapes: tuple[str, ...] = SHAPES
    colours: tuple[RGB, ...] = (
        (220, 30, 30),
        (30, 160, 40),
        (30, 70, 220),
        (230, 190, 20),
        (170, 40, 190),
        (20, 180, 190),
        (240, 120, 20),
        (90, 90, 90),
    )
    background: RGB = (255, 255, 255)
    min_size: int = 9
    max_size: int = 15
    gap: int = 2
    prompt: str = "How many shapes are in the image?"
    num_train: int = 2000
    num_eval: int = 200
    seed: int = 0
    teacher_accuracy: float = 0.3
    """The base model's teacher is right this often and otherwise over-counts by one."""
    hidden_size: int = 64
    num_layers: int = 2
    vision_hidden: int = 32
    vision_depth: int = 2
    init_std: float = 0.2
    sft_steps: int = 600
    sft_batch: int = 16
    sft_learning_rate: float = 3e-3

    def __post_init__(self):
        bad = [s for s in self.shapes if s not in SHAPES]
        if not self.shapes or bad:
            raise ValueError(f"VisualTask.shapes must be some of {SHAPES}, got {self.shapes!r}")
        if not 1 <= self.max_count <= len(self.colours):
            raise ValueError(
                f"VisualTask.max_count={self.max_count} must be in 1..{len(self.colours)} "
                "(each shape of an image takes its own colour)"
            )
        if len(set(self.colours)) != len(self.colours) or self.background in self.colours:
            raise ValueError("VisualTask.colours must be distinct and differ from the background")
        if not 3 <= self.min_size <= self.max_size <= self.image_size - 2:
            raise ValueError(
                f"VisualTask sizes need 3 <= min_size <= max_size <= image_size - 2, got "
                f"{self.min_size}, {self.max_size}, {self.image_size}"
            )
        # max_count boxes of max_size must fit: a loose check, the placement retries anyway
        if self.max_count * (self.max_size + self.gap) ** 2 > 0.6 * self.image_size**2:
            raise ValueError(
                f"{self.max_count} shapes of {self.max_size} px cannot be placed reliably in "
                f"{self.image_size} px images: lower max_count or max_size, or raise image_size"
            )

    def answer(self, count: int) -> str:
        return str(count)


def _place(task: VisualTask, rng: np.random.Generator, count: int) -> list[tuple[int, int, int]]:
    """``count`` boxes ``(x, y, side)`` at least ``gap`` apart, inside a 1-pixel margin."""
    for _ in range(1000):
        boxes: list[tuple[int, int, int]] = []
        for _ in range(count):
            for _ in range(100):
                s = int(rng.integers(task.min_size, task.max_size + 1))
                x = int(rng.integers(1, task.image_size - s))
                y = int(rng.integers(1, task.image_size - s))
                g = task.gap
                if all(
                    x + s + g <= bx or bx + bs + g <= x or y + s + g <= by or by + bs + g <= y
                    for bx, by, bs in boxes
                ):
                    boxes.append((x, y, s))
                    break
            else:
                break
        if len(boxes) == count:
            return boxes
    raise RuntimeError(
        f"could not place {count} shapes in {task.image_size} px"
    )  # pragma: no cover


def draw(task: VisualTask, rng: np.random.Generator) -> tuple[Image.Image, int]:
    """One picture and its count: ``count`` uniform in 1..max_count, each shape a random kind,
    a colour of its own, a random box (``_place``)."""
    count = int(rng.integers(1, task.max_count + 1))
    colours = rng.choice(len(task.colours), count, replace=False)
    kinds = rng.integers(0, len(task.shapes), count)
    image = Image.new("RGB", (task.image_size, task.image_size), task.background)
    pen = ImageDraw.Draw(image)
    for (x, y, s), c, k in zip(_place(task, rng, count), colours, kinds):
        fill, box = task.colours[int(c)], (x, y, x + s - 1, y + s - 1)
        kind = task.shapes[int(k)]
        if kind == "square":
            pen.rectangle(box, fill=fill)
        elif kind == "disc":
            pen.ellipse(box, fill=fill)
        else:  # triangle: apex at the top middle
            pen.polygon([(x + (s - 1) / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=fill)
    return image, count


def encode_png(image: Image.Image) -> str:
    """The image as a base64 PNG string (what ``decode_image`` reads)."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _records(task: VisualTask, stream: int, n: int, exclude: set[str]) -> list[dict]:
    """``n`` records of the seed stream ``stream``, skipping images whose pixels hash into
    ``exclude`` (and adding theirs to it)."""
    rng = np.random.default_rng([task.seed, stream])
    out: list[dict] = []
    while len(out) < n:
        image, count = draw(task, rng)
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        if digest in exclude:
            continue
        exclude.add(digest)
        out.append(
            {
                "prompt": task.prompt,
                "image": encode_png(image),
                "answer": task.answer(count),
                "data_source": "count",
            }
        )
    return out


def make_splits(task: VisualTask) -> tuple[list[dict], list[dict]]:
    """Train and held-out records ``{"prompt", "image" (base64 PNG), "answer", "data_source"}``:
    deterministic in ``task.seed``, no image in both (nor twice in one split)."""
    seen: set[str] = set()
    train = _records(task, 0, task.num_train, seen)
    return train, _records(task, 1, task.num_eval, seen)
