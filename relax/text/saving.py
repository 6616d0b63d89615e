"""Writing a tokenizer's sidecar files so transformers and relax load it back unchanged.

Source files are copied, not re-serialised, wherever they exist: ``chat_template.jinja`` (and
``chat_templates/*.jinja``), ``special_tokens_map.json``, ``generation_config.json``. The
``tokenizer_config.json`` written is the source one with:

- ``tokenizer_class`` set to a class transformers 5.23 loads equivalently without network
  (``PreTrainedTokenizerFast`` for ``tokenizer.json``, ``SentencePieceBackend`` for a
  sentencepiece model), and ``auto_map`` (remote code) dropped;
- the named special tokens written out (also those that came from a legacy
  ``special_tokens_map.json``), AddedToken dicts with the ``"__type": "AddedToken"`` marker
  transformers 5 needs to read them;
- ``chat_template`` removed when the template came as ``.jinja`` files (which are copied).

Into a directory other than the source one, stale ``chat_template.jinja`` /
``chat_templates/*.jinja`` files are removed when the template came from the config (or there
is none): transformers prefers those files over the config. An existing
``generation_config.json`` (e.g. written by ``relax.models.hf.checkpoint.save_pretrained``) is kept.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relax.models.hf.weights_io import write_json
from relax.text.files import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    Sidecars,
)


def save_sidecars(
    sidecars: Sidecars, out: Path, *, tokenizer_class: str, updates: Mapping[str, Any] | None = None
) -> None:
    """Write ``tokenizer_config.json`` and copy the other sidecar files into ``out``."""
    config = dict(sidecars.config)
    config.pop("auto_map", None)
    config["tokenizer_class"] = tokenizer_class
    for name, spec in sidecars.named_tokens.items():
        config[name] = spec if isinstance(spec, str) else {"__type": "AddedToken", **spec}
    config.update(updates or {})
    same_dir = _same_path(sidecars.directory, out)
    if sidecars.template_files:
        config.pop("chat_template", None)
        for path in sidecars.template_files:
            copy_file(path, out / path.relative_to(sidecars.directory))
    elif not same_dir:
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
        if (out / CHAT_TEMPLATE_DIR).is_dir():
            for stale in (out / CHAT_TEMPLATE_DIR).glob("*.jinja"):
                stale.unlink()
    write_json(out / TOKENIZER_CONFIG, config, sort_keys=False, ensure_ascii=False)
    if sidecars.special_tokens_map_path is not None:
        copy_file(sidecars.special_tokens_map_path, out / SPECIAL_TOKENS_MAP)
    if sidecars.generation_config_path is not None and not (out / GENERATION_CONFIG).exists():
        copy_file(sidecars.generation_config_path, out / GENERATION_CONFIG)


def copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` (parents created); nothing to do when they are one file."""
    if target.exists() and _same_path(source, target):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
