"""The checkpoint ``relax eval`` evaluates, and its tokenizer.

--model HF_DIR                      a Hugging Face directory (config.json + safetensors)
--model BASE --adapter ADAPTER_DIR  a PEFT LoRA adapter on its base (tokenizer: the adapter
                                    directory's when it has one, else the base's)
--run-dir RUN                       a relax run: its final export ``RUN/final_hf``, else its
                                    newest periodic export ``RUN/hf/step-N``

A vision-language directory (Gemma 3, Qwen2.5-VL) is evaluated by its language model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from relax.text.base import TextTokenizer


class Policy(NamedTuple):
    """A model to evaluate, its tokenizer and where it came from (for the report)."""

    model: object
    tokenizer: TextTokenizer
    source: str


def export_steps(run_dir: str | Path) -> list[int]:
    """The steps of a run's periodic exports (``RUN/hf/step-N`` holding a ``config.json``),
    ascending."""
    return sorted(
        int(m.group(1))
        for p in (Path(run_dir) / "hf").glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "config.json").is_file()
    )


def run_export(run_dir: str | Path) -> Path:
    """The Hugging Face export of a relax run: ``final_hf``, else the ``hf/step-N`` with the largest
    N; an error names the directory when it has neither."""
    run = Path(run_dir)
    if (run / "final_hf" / "config.json").is_file():
        return run / "final_hf"
    steps = export_steps(run)
    if not steps:
        raise FileNotFoundError(
            f"{run}: no Hugging Face export (final_hf/ or hf/step-N/); a run exports one at its "
            f"end (--export-hf) or every --export-every steps"
        )
    return run / "hf" / f"step-{steps[-1]}"


def language_model(path: str | Path, param_dtype=None):
    """The language model of a Hugging Face directory, computing in float32 (``param_dtype``:
    its parameters cast to it; None: as stored): a text model, or the language model of a
    vision-language one (Gemma 3, Qwen2.5-VL: its vision part is left out, the benchmarks are
    text)."""
    from relax.models.hf.checkpoint import load_pretrained
    from relax.models.vision.families import load_vision_language, vision_family_of

    kw = dict(dtype=jnp.float32, param_dtype=param_dtype)
    if vision_family_of(path) is None:
        return load_pretrained(path, **kw)
    return load_vision_language(path, **kw).language_model


def load_policy(
    model: str | None = None, adapter: str | None = None, run_dir: str | None = None
) -> Policy:
    """The policy of ``model`` (+ ``adapter``) or ``run_dir`` (exactly one of them), float32."""
    from relax.text.loader import load_tokenizer

    if (model is None) == (run_dir is None):
        raise ValueError("give exactly one of --model and --run-dir")
    if run_dir is not None and adapter is not None:
        raise ValueError("--adapter goes with --model (its base), not with --run-dir")
    base = Path(model) if model is not None else run_export(run_dir)
    net = language_model(base)
    tok_dir, source = base, str(base)
    if adapter is not None:
        from relax.models.adapters.peft import load_adapter

        net = load_adapter(net, adapter)
        source = f"{base} + adapter {adapter}"
        if any((Path(adapter) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            tok_dir = Path(adapter)
    return Policy(net, load_tokenizer(tok_dir), source)
