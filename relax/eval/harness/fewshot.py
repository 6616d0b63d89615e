"""Few-shot contexts exactly as lm-evaluation-harness 0.4.13 builds them for plain-text prompts
(``ConfigurableTask.fewshot_context`` with its ``ContextSampler``), so prompts are byte-identical.

Selection (``lm_eval/api/samplers.py``): one ``random.Random(fewshot_seed)`` (default 1234) is
shared by all evaluated items, drawn in item order; for each item

    default  rnd.sample(pool, n)                                  (few-shot split != test split)
             [d for d in rnd.sample(pool, n + 1) if d != item][:n] (same split), and when fewer
             than n remain (duplicates of the item): rnd.sample([d != item], n)
    first_n  pool[:n]  (without the item when the splits are the same)

so item i's examples depend on the draws of items 0..i-1: evaluating the first N items of a file
gives the same prompts as lm-eval's ``--limit N``.

Text (``build_qa_turn``): each example is ``text + target_delimiter + target + fewshot_delimiter``
(defaults ``" "`` and ``"\\n\\n"``; an example with an empty target is its text alone), then the
item's own text; a ``description`` comes first, as it is (lm-eval's system message has no
delimiter of its own).

Chat (``chat_messages``, lm-eval's ``--apply_chat_template``): the system instruction, if any, is
a system message; with ``multiturn`` (lm-eval's ``--fewshot_as_multiturn``, on by default with
a chat template) each example is a user turn (its text) and an assistant turn (its target, none
when empty) and the item a last user turn, with no delimiters; without it the plain prompt is
one user turn. The model's chat template then renders them with a generation prompt.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

Doc = dict


def sample_fewshot(
    docs: Sequence[Doc],
    pool: Sequence[Doc],
    n: int,
    *,
    seed: int | None = 1234,
    sampler: str = "default",
    same_split: bool = False,
) -> list[list[Doc]]:
    """The ``n`` few-shot examples of each of ``docs``, in order (see the module docstring)."""
    if sampler not in ("default", "first_n"):
        raise ValueError(f"sampler must be 'default' or 'first_n', got {sampler!r}")
    if n < 0:
        raise ValueError(f"the number of few-shot examples must be >= 0, got {n}")
    if n and not pool:
        raise ValueError(
            f"{n}-shot prompts need few-shot examples, and the few-shot split is empty"
        )
    rnd = random.Random(seed)
    out = []
    for doc in docs:
        if n == 0:
            out.append([])
        elif sampler == "first_n":
            rows = [d for d in pool if d != doc] if same_split else list(pool)
            if n > len(rows):
                raise ValueError(f"{n}-shot prompts need {n} examples, the pool has {len(rows)}")
            out.append(rows[:n])
        elif not same_split:
            out.append(rnd.sample(list(pool), n))
        else:
            rows = [d for d in rnd.sample(list(pool), n + 1) if d != doc][:n]
            if len(rows) < n:
                rows = rnd.sample([d for d in pool if d != doc], n)
            out.append(rows)
    return out


@dataclasses.dataclass(frozen=True)
class PromptLayout:
    """How a task writes a prompt: an item's text, a few-shot example's target and the
    delimiters after a question (before its target) and after each example."""

    doc_to_text: Callable[[Doc], str]
    fewshot_target: Callable[[Doc], str]
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"


def chat_messages(
    doc: Doc,
    examples: Sequence[Doc],
    layout: PromptLayout,
    *,
    system: str = "",
    multiturn: bool = True,
) -> list[dict[str, str]]:
    """One item's prompt as chat messages (the module docstring's "Chat")."""
    messages = [{"role": "system", "content": system}] if system else []
    if not multiturn:
        return [*messages, {"role": "user", "content": build_context(doc, examples, layout)}]
    for ex in examples:
        messages.append({"role": "user", "content": layout.doc_to_text(ex)})
        if target := layout.fewshot_target(ex):
            messages.append({"role": "assistant", "content": target})
    return [*messages, {"role": "user", "content": layout.doc_to_text(doc)}]


def build_context(
    doc: Doc, examples: Sequence[Doc], layout: PromptLayout, description: str = ""
) -> str:
    """One item's prompt: ``description``, the examples with their targets, the item's text."""
    parts = [description]
    for ex in examples:
        target = layout.fewshot_target(ex)
        tail = layout.target_delimiter + target + layout.fewshot_delimiter if target else ""
        parts.append(layout.doc_to_text(ex) + tail)
    parts.append(layout.doc_to_text(doc))
    return "".join(parts)
