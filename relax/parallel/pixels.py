"""A multi-process batch's images for a trained vision tower (``--train-vision`` on several
processes).

Each process reads its own rows of a step and their images. A trained tower runs inside the
step's programs over the whole global batch, so every process needs every image, in the global
rows' order (process 0's rows first, as ``place_process_rows`` lays them out) and under one
static grid: ``global_pixels`` gathers them through host memory and places them replicated.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from relax.models.vision.families import Pixels
from relax.parallel import distributed
from relax.parallel.mesh import replicated

__all__ = ["global_pixels"]


def global_pixels(pixel_values, grid, mesh: Mesh) -> Pixels | None:
    """Every process's ``pixel_values`` (its rows' images, leading axis the images or their
    patches) and ``grid`` (Qwen2.5-VL's ``(t, h, w)`` per image; Gemma 3: empty), concatenated in
    process order and replicated on ``mesh`` (every process calls this); None when no process
    has an image."""
    parts = [a for a in distributed.all_arrays(np.asarray(pixel_values)) if a.size]
    if not parts:
        return None
    local = np.asarray(grid, np.int64).reshape(-1, 3)
    grids = distributed.all_rows(local)
    values = np.concatenate(parts)
    placed = distributed.put(values, replicated(mesh))
    return Pixels(placed, tuple(tuple(int(v) for v in g) for g in grids))
