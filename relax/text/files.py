"""What a Hugging Face model directory says about its tokenizer, besides the vocabulary itself.

A model directory holds the vocabulary (``tokenizer.json`` or a sentencepiece ``tokenizer.model``)
and sidecar files, read here the way transformers 5.23 reads them:

- ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, ``unk_token``,
  ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``; each a string or an AddedToken
  dict ``{"content": ..., "lstrip": ..., ...}``), model-specific ``*_token`` entries (e.g.
  ``image_token``), ``extra_special_tokens`` / ``additional_special_tokens``,
  ``added_tokens_decoder`` (``{"id": {AddedToken dict}}``) and ``chat_template`` (a string or a
  list of ``{"name", "template"}``).
- ``special_tokens_map.json``: legacy; read only when the config has no ``added_tokens_decoder``,
  and then its entries override the config's (transformers' ``_from_pretrained``).
- ``chat_template.jinja`` (the default template) and ``chat_templates/<name>.jinja``: when any
  exists they replace the config's ``chat_template``.
- ``generation_config.json``: its ``eos_token_id`` (an int or a list) is what generation stops on.

Every problem is a :class:`TokenizerFormatError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from relax.models.hf.bounded_json import loads

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
GENERATION_CONFIG = "generation_config.json"

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in its order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The keys of a serialised tokenizers.AddedToken.
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")

# A special token as configured: the string, or an AddedToken dict (only ADDED_TOKEN_FIELDS kept).
TokenSpec = str | dict[str, Any]
ChatTemplates = str | dict[str, str]


class TokenizerFormatError(ValueError):
    """A tokenizer file is missing, unreadable or malformed; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Sidecars:
    """The sidecar files of one model directory, parsed.

    ``config``: ``tokenizer_config.json`` as read (``{}`` when absent). ``named_tokens``: the
    named special tokens, then the model-specific ``*_token`` ones, in transformers' order (these
    are also the chat template's token variables). ``extra_tokens``: ``extra_special_tokens``.
    ``added_tokens``: ``added_tokens_decoder`` as ``(id, AddedToken dict)`` sorted by id.
    ``chat_template``: one template, a ``{name: template}`` dict, or None; ``template_files``
    lists the ``.jinja`` files it came from (empty when it came from the config).
    ``generation_eos``: ``generation_config.json``'s ``eos_token_id`` as a tuple.
    """

    directory: Path
    config: dict[str, Any]
    named_tokens: dict[str, TokenSpec]
    extra_tokens: tuple[TokenSpec, ...]
    added_tokens: tuple[tuple[int, dict[str, Any]], ...]
    chat_template: ChatTemplates | None
    template_files: tuple[Path, ...]
    generation_eos: tuple[int, ...]
    special_tokens_map_path: Path | None
    generation_config_path: Path | None

    @property
    def token_strings(self) -> dict[str, str]:
        """``named_tokens`` as plain strings (what chat templates see as ``bos_token`` etc.)."""
        return {name: token_content(spec) for name, spec in self.named_tokens.items()}

    @property
    def extra_strings(self) -> tuple[str, ...]:
        """``extra_tokens`` as plain strings."""
        return tuple(token_content(spec) for spec in self.extra_tokens)


def token_content(spec: TokenSpec) -> str:
    """The text of a configured token (a string or an AddedToken dict)."""
    return spec if isinstance(spec, str) else spec["content"]


def read_json(path: Path) -> Any:
    """Parse a JSON file within ``relax.models.hf.bounded_json``'s bounds (nesting, numbers),
    naming it, the line and the column in any error."""
    try:
        return loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerFormatError(f"cannot read {path}: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerFormatError(f"{path} is not valid JSON: {e}") from e


def read_sidecars(directory: Path) -> Sidecars:
    """Read the sidecar files of ``directory`` (any of them may be absent)."""
    config_path = directory / TOKENIZER_CONFIG
    config = _read_object(config_path) if config_path.is_file() else {}
    source = str(config_path)
    values = dict(config)
    map_path = directory / SPECIAL_TOKENS_MAP
    map_path = map_path if map_path.is_file() else None
    if map_path is not None and "added_tokens_decoder" not in config:
        values.update(_read_object(map_path))  # legacy: the map wins over the config
        source = f"{config_path} / {map_path}"
    named = {}
    for name in SPECIAL_TOKEN_NAMES:
        spec = _token_spec(values.get(name), f"{source}: {name}")
        if spec is not None:
            named[name] = spec
    for name, value in values.items():  # model-specific tokens, e.g. image_token
        if name.endswith("_token") and name not in SPECIAL_TOKEN_NAMES and _is_token(value):
            named[name] = _token_spec(value, f"{source}: {name}")
    extra = values.get("extra_special_tokens", values.get("additional_special_tokens")) or []
    if isinstance(extra, dict):  # named extras behave as model-specific tokens
        named.update(
            {k: _token_spec(v, f"{source}: extra_special_tokens.{k}") for k, v in extra.items()}
        )
        extra = []
    if not isinstance(extra, list):
        raise TokenizerFormatError(f"{source}: extra_special_tokens must be a list, got {extra!r}")
    extras = tuple(_token_spec(v, f"{source}: extra_special_tokens") for v in extra)
    templates, template_files = _read_chat_templates(directory, config, config_path)
    generation_path = directory / GENERATION_CONFIG
    generation_path = generation_path if generation_path.is_file() else None
    return Sidecars(
        directory=directory,
        config=config,
        named_tokens=named,
        extra_tokens=extras,
        added_tokens=_added_tokens(config.get("added_tokens_decoder") or {}, config_path),
        chat_template=templates,
        template_files=template_files,
        generation_eos=_generation_eos(generation_path),
        special_tokens_map_path=map_path,
        generation_config_path=generation_path,
    )


def _read_object(path: Path) -> dict[str, Any]:
    value = read_json(path)
    if not isinstance(value, dict):
        raise TokenizerFormatError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, dict) and isinstance(value.get("content"), str)
    )


def _token_spec(value: Any, where: str) -> TokenSpec | None:
    """A configured token as a string or a cleaned AddedToken dict; None when unset."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return {k: value[k] for k in ADDED_TOKEN_FIELDS if k in value}
    raise TokenizerFormatError(
        f"{where} must be a string or an AddedToken dict with a 'content' string, got {value!r}"
    )


def _added_tokens(decoder: Any, path: Path) -> tuple[tuple[int, dict[str, Any]], ...]:
    if not isinstance(decoder, dict):
        raise TokenizerFormatError(
            f"{path}: added_tokens_decoder must be an object, got {decoder!r}"
        )
    out = []
    for key, value in decoder.items():
        where = f"{path}: added_tokens_decoder[{key!r}]"
        try:
            index = int(key)
        except ValueError:
            raise TokenizerFormatError(f"{where}: the key must be a token id") from None
        spec = _token_spec(value, where)
        out.append((index, spec if isinstance(spec, dict) else {"content": spec}))
    return tuple(sorted(out, key=lambda item: item[0]))


def _read_chat_templates(
    directory: Path, config: dict[str, Any], config_path: Path
) -> tuple[ChatTemplates | None, tuple[Path, ...]]:
    """Templates from ``.jinja`` files if any exist, else from the config."""
    files: dict[str, Path] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = directory / CHAT_TEMPLATE_FILE
    template_dir = directory / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        for path in sorted(template_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path
    if files:
        texts = {}
        for name, path in files.items():
            try:
                texts[name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerFormatError(f"cannot read chat template {path}: {e}") from e
        single = list(files) == ["default"]
        return (texts["default"] if single else texts), tuple(files.values())
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value, ()
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}, ()
    raise TokenizerFormatError(
        f"{config_path}: chat_template must be a string or a list of "
        f"{{'name': str, 'template': str}}, got {type(value).__name__}"
    )


def _generation_eos(path: Path | None) -> tuple[int, ...]:
    if path is None:
        return ()
    config = _read_object(path)
    value = config.get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerFormatError(
            f"{path}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return tuple(values)
