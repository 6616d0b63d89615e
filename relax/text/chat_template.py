"""Chat templates rendered exactly as transformers 5.23 renders them, without transformers.

A replica of ``transformers.utils.chat_template_utils`` (``_compile_jinja_template``,
``render_jinja_template``) and of the template choice in ``PreTrainedTokenizerBase``
(``get_chat_template``):

- the environment is ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
  with the ``loopcontrols`` extension (``break`` / ``continue``) and a ``{% generation %}`` tag
  that renders its body (transformers uses it to find assistant tokens; not tracked here);
- ``tojson`` is ``json.dumps(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`` (jinja's own escapes ``<>&'`` for HTML); globals ``raise_exception``
  (raises ``jinja2.exceptions.TemplateError(message)``, the text passed through unchanged),
  ``strftime_now(format)`` (local time), ``dict`` and ``namespace`` (which refuses
  underscore-prefixed attributes);
- variables: ``messages``, ``tools`` (None when not given), ``documents`` (None when not
  given, but defined), ``add_generation_prompt``, the tokenizer's special token strings, then
  any extra keyword arguments (which override the token strings);
- inputs are rebuilt from plain JSON types first (a message key whose value is None is dropped,
  tuples stay tuples, numpy scalars become Python ones, dataclasses and pydantic models become
  dicts, anything else a ``"<TypeName>"`` placeholder), and a message's reasoning given as
  ``reasoning_content`` / ``thinking`` / ``reasoning`` is exposed under ``thinking`` and
  ``reasoning_content``;
- ``continue_final_message`` leaves the last message open, as transformers does.

Not replicated: tools given as Python functions (transformers derives a JSON schema from the
signature and docstring; pass the schema dict instead), batches of conversations, assistant
token masks and ``sanitize_control_tokens``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from relax.text.files import ChatTemplates

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class NoChatTemplateError(ValueError):
    """A chat prompt was asked of a tokenizer that has no chat template."""


def select_template(
    templates: ChatTemplates | None,
    requested: str | None,
    tools: Sequence[Any] | None,
    path: Path | str,
) -> str:
    """The template source to render, chosen as transformers' ``get_chat_template`` does.

    With several named templates: ``requested`` as a name, else ``"tool_use"`` when tools are
    given and it exists, else ``"default"``. A ``requested`` that is not a name (or any
    ``requested`` with a single template) is itself the template source.
    """
    if isinstance(templates, dict):
        if requested is not None and requested in templates:
            return templates[requested]
        if requested is not None:
            return requested
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(
            f"{path} has several chat templates and none is named 'default'; pass "
            f"chat_template= one of {sorted(templates)}"
        )
    if requested is not None:
        return requested
    if templates is None:
        raise NoChatTemplateError(
            f"{path} has no chat template (no chat_template in tokenizer_config.json and no "
            f"chat_template.jinja); pass chat_template= a Jinja template"
        )
    return templates


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render one conversation with ``template`` (a Jinja source string).

    ``variables`` are the extra template variables (special token strings, then keyword
    arguments such as ``enable_thinking``). Template errors propagate as jinja2 raises them
    (``raise_exception("...")`` gives ``jinja2.exceptions.TemplateError("...")``).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: the first "
            "continues the last message, the second starts a new assistant message"
        )
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a dict, got {message!r}")
        chat.append(plain_template_data({k: v for k, v in message.items() if v is not None}))
    chat = _alias_reasoning(chat)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(
                    f"tools must be JSON-schema dicts (functions are not converted), got {tool!r}"
                )
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    final = None
    if continue_final_message:
        final = _tag_final_message(chat, template, continue_final_message)
    rendered = compile_template(template).render(
        messages=chat,
        tools=plain_template_data(tools),
        documents=plain_template_data(documents),
        add_generation_prompt=add_generation_prompt,
        **plain_template_data(dict(variables or {})),
    )
    return rendered if final is None else _cut_at_tag(rendered, final)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in transformers' sandboxed environment (cached)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def plain_template_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(v) for v in value)
    if isinstance(value, np.generic):
        return plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict[str, Any]], template: str, field: bool | str) -> str:
    """Append the continue tag to the last message's text; returns that text (untagged)."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted '
            f"field in the chat_template"
        )
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue "
            "in the final message!"
        )
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the "
            f"chat after applying the chat template: {final.strip()!r}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute."
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()
