"""The start-up report: what a run will do, before it does it.

Every trainer builds one once its model and data are loaded, before anything compiles: the
flags that differ from their defaults, the model (family, size, dtypes, devices, mesh), the data
(rows read and held out, prompt-length percentiles, rows over the token budget and what became of
them, the padded length), the stop tokens and the first prompt as the model sees it. It is
printed, and written to the run directory as ``startup.txt`` with the whole effective config as
JSON beside it (``config.json``); an online run adds, once its programs are compiled before the
first step, a last section "compiled ahead" (``StartupReport.with_section``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.cli.flags import flag_values
from relax.data.prompt_budget import PromptStats
from relax.models.adapters.operations import split_trainable
from relax.text import TextTokenizer
from relax.train.logs import CONFIG_FILE, STARTUP_FILE

FIRST_PROMPT_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """Titled sections of lines, and the effective config (JSON-able)."""

    sections: tuple[tuple[str, tuple[str, ...]], ...]
    config: dict

    def text(self) -> str:
        out = []
        for title, lines in self.sections:
            out.append(f"== {title}")
            out.extend(f"  {line}" for line in lines)
        return "\n".join(out)

    def with_section(self, title: str, lines: Sequence[str]) -> StartupReport:
        """This report with one more section, ``title``'s ``lines``, at its end."""
        return dataclasses.replace(self, sections=(*self.sections, (title, tuple(lines))))

    def write(self, run_dir: Path) -> None:
        """``startup.txt`` and ``config.json`` in ``run_dir`` (main process only)."""
        (run_dir / STARTUP_FILE).write_text(self.text() + "\n")
        (run_dir / CONFIG_FILE).write_text(json.dumps(self.config, indent=2, default=str) + "\n")


def config_lines(cfg: Any) -> tuple[str, ...]:
    """``--flag value (default d)`` for every field of ``cfg`` that differs from its class default."""
    defaults = flag_values(type(cfg)())
    now = flag_values(cfg)
    lines = tuple(
        f"{k} {now[k]!r} (default {defaults.get(k)!r})" for k in now if now[k] != defaults.get(k)
    )
    return lines or ("every flag at its default",)


def _size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def model_lines(model, cfg: Any, mesh=None) -> tuple[str, ...]:
    """Family, shape, parameters (trainable ones), dtypes (as loaded), devices and mesh."""
    c = model.config
    total, trainable = _size(model), _size(split_trainable(model)[0])
    devices = jax.devices()
    lora = getattr(cfg, "lora", None)
    return (
        f"{getattr(cfg, 'model', None) or 'built-in task model'}: {c.family}, {c.num_layers} layers, width "
        f"{c.hidden_size}, {c.num_heads} heads ({c.num_kv_heads} KV), vocab {c.vocab_size}, "
        f"{c.max_position_embeddings} positions",
        f"parameters {total:,} ({trainable:,} trainable), param dtype {jnp.dtype(model.embed.dtype).name}, compute "
        f"dtype {jnp.dtype(model.dtype).name}"
        + (f", LoRA rank {lora.rank}" if lora is not None and lora.enabled else ""),
        model.precision.describe(model.dtype) + " (the sampler's and every training forward's)",
        f"{len(devices)} {devices[0].platform} device(s), {jax.process_count()} process(es)"
        + ("" if mesh is None else f", mesh {dict(mesh.shape)}"),
    )


def prompt_lines(stats: PromptStats, label: str) -> tuple[str, ...]:
    """Rows, prompt-length percentiles, and the over-budget rows with their fate."""
    pct = ", ".join(f"{k} {v}" for k, v in stats.percentiles().items())
    lines = [f"{label}: {stats.rows} rows, {stats.kept} kept; prompt tokens {pct or '-'}"]
    message = stats.over_budget_message(label)
    lines.append(
        message if message is not None else f"no prompt over --max-prompt-tokens {stats.budget}"
    )
    if stats.images is not None:
        s = stats.image_summary()
        per = s["images_per_prompt"]
        lines.append(
            f"{label} images: {s['images']} in all, {per['min']}-{per['max']} per prompt"
            + (f"; {message}" if (message := stats.bad_images_message(label)) else "")
        )
    return tuple(lines)


def token_lines(
    tokenizer: TextTokenizer,
    eos_ids: Sequence[int],
    stop_strings: Sequence[str],
    max_new_tokens: int,
) -> tuple[str, ...]:
    """The stop tokens (ids and text), stop strings, pad token and completion budget."""
    named = ", ".join(f"{i} {tokenizer.decode([i])!r}" for i in eos_ids)
    pad = tokenizer.pad_token_id
    return (
        f"stop tokens: {named or 'none'}"
        + (f"; stop strings {list(stop_strings)!r}" if stop_strings else ""),
        f"pad token {pad} {tokenizer.decode([pad])!r}; at most {max_new_tokens} new tokens per completion",
    )


def first_prompt_lines(text: str) -> tuple[str, ...]:
    """The first prompt as the model sees it (cut at ``FIRST_PROMPT_CHARS``)."""
    shown = (
        text
        if len(text) <= FIRST_PROMPT_CHARS
        else text[:FIRST_PROMPT_CHARS] + f"... ({len(text)} chars)"
    )
    return tuple(shown.split("\n")) if shown else ("(none)",)


def first_row_lines(record: Any) -> tuple[str, ...]:
    """The first training row as JSON (cut at ``FIRST_PROMPT_CHARS``)."""
    return first_prompt_lines(json.dumps(record, ensure_ascii=False, default=str))


def run_report(
    cfg: Any,
    model,
    data: Sequence[str],
    *,
    mesh=None,
    extra: Sequence[tuple[str, Sequence[str]]] = (),
) -> StartupReport:
    """A report of the config, the model, the ``data`` lines and ``extra`` sections."""
    sections = [
        ("config", config_lines(cfg)),
        ("model", model_lines(model, cfg, mesh)),
        ("data", tuple(data)),
    ]
    sections += [(title, tuple(lines)) for title, lines in extra]
    return StartupReport(tuple(sections), dataclasses.asdict(cfg))
