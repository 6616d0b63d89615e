"""What a plan reads of a model directory, or of its ``config.json`` alone: the shapes
(``ModelConfig``) and the dtype its parameters are stored in; never a weight.

A teacher (``relax distill --teacher``) and a reward model (``--reward-model``) are loaded with
their parameters as stored (``load_pretrained`` / ``load_reward_model`` with ``param_dtype=None``),
so their plan takes the dtype their ``config.json`` names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from relax.models.config.families import BY_ARCHITECTURE, FAMILIES
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.hf.config import config_from_hf


def config_json(path: str | Path) -> tuple[Path, dict]:
    """``(file, parsed)``: the ``config.json`` of a model directory, or the file itself."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return file, json.loads(file.read_text())


def stored_dtype(path: str | Path) -> Any:
    """The dtype the checkpoint's parameters are stored in, as its ``config.json`` names it
    (``dtype``, transformers 5; ``torch_dtype``, 4.x); float32 when it names none or another."""
    _, d = config_json(path)
    return DTYPES.get(d.get("dtype") or d.get("torch_dtype") or "float32", jnp.float32)


def value_model_config(path: str | Path) -> ModelConfig:
    """The backbone's ``ModelConfig`` of a value model (a ``<Family>ForSequenceClassification``
    reward model): read as its family's causal LM, with tied embeddings as
    ``relax.models.heads.critic.load_critic`` reads it (a value model has no ``lm_head``)."""
    file, d = config_json(path)
    archs = d.get("architectures") or []
    if archs and archs[0] in BY_ARCHITECTURE:
        d = {**d, "architectures": [FAMILIES[BY_ARCHITECTURE[archs[0]][1]].causal_lm]}
    return dataclasses.replace(config_from_hf(d, source=str(file)), tie_word_embeddings=True)
