"""A built-in multi-turn tool-use task: multiply two numbers, with a calculator tool.

Prompt ``"What is 347 * 86?"``, answer ``"29842"``, reward 1.0 iff the final answer's integer is
right. The model may call ``multiply`` (Hermes / Qwen 2.5 format) and read its result in a ``tool``
turn before answering; the environment is a ``ToolEnvironment`` over the row. A tiny model cannot
multiply, so answering directly is mostly wrong, while copying the numbers into a call and the
result into the answer is easy. The base model imitates a *noisy teacher* that calls the tool only
``tool_rate`` of the time and otherwise answers directly (with the true product), so it knows both
behaviours but mostly prefers the losing one; multi-turn GRPO must learn to use the tool.

The teacher's transcripts are tokenized exactly as a multi-turn rollout builds a trajectory:
``ChatFormat.prompt_ids``, then each assistant turn encoded with its stop token, then each
observation's ``ChatFormat.observation_ids``; the loss is on the assistant turns only. Everything
(data, a byte-level BPE tokenizer with a ChatML template, the model) is generated on the spot.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from relax.environments import Action, Tool, ToolEnvironment
from relax.environments.chat import ChatFormat
from relax.models.config.model import ModelConfig
from relax.models.decoder.transformer import Transformer
from relax.tasks.base import supervised_loop, tiny_llama
from relax.text import TextTokenizer, load_tokenizer, render_chat


@dataclasses.dataclass(frozen=True)
class AgentTask:
    """The problems (a ``digits_a``-digit times a ``digits_b``-digit number), the environment's turn
    budget, the noisy teacher, and the base model's size and supervised phase."""

    digits_a: int = 3
    digits_b: int = 2
    num_train: int = 4000
    num_eval: int = 200
    tool_rate: float = 0.35
    max_turns: int = 3
    seed: int = 0
    vocab_size: int = 384
    hidden_size: int = 64
    num_layers: int = 2
    sft_steps: int = 800
    sft_batch: int = 64
    sft_learning_rate: float = 3e-3


SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
]  # pad / bos, turn start, end of turn (eos)
TOOL_TOKENS = [
    "<tool_call>",
    "</tool_call>",
]  # added, not special (as Qwen 2.5): decoded text keeps them

# A compact ChatML template (Qwen 2.5's layout): a one-line system turn naming the tools, tool
# results as a user turn of <tool_response> blocks. Newlines after a block tag are written as
# expressions: chat templates render with trim_blocks, which would eat them.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} "
    "{{ t.function.name if t.function is defined else t.name }}{% endfor %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


def make_splits(task: AgentTask) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out records ``{"prompt", "a", "b", "answer", "data_source"}``: no
    ``(a, b)`` pair of the held-out split is in the train split."""
    rng = random.Random(task.seed)
    lo_a, lo_b = 10 ** (task.digits_a - 1), 10 ** (task.digits_b - 1)
    total = task.num_train + task.num_eval
    if total > 0.5 * (9 * lo_a) * (9 * lo_b):
        raise ValueError(
            f"{total} problems asked for, too many for {task.digits_a} x {task.digits_b} digits"
        )
    seen: set[tuple[int, int]] = set()
    rows: list[dict] = []
    while len(rows) < total:
        a, b = rng.randrange(lo_a, 10 * lo_a), rng.randrange(lo_b, 10 * lo_b)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append(
                {
                    "prompt": f"What is {a} * {b}?",
                    "a": a,
                    "b": b,
                    "answer": str(a * b),
                    "data_source": f"agent/mul{task.digits_a}x{task.digits_b}",
                }
            )
    return rows[: task.num_train], rows[task.num_train :]


def tools(task: AgentTask) -> list[Tool]:
    """The calculator: ``multiply(a, b)`` of two integers (no ``task`` field changes it)."""
    del task
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    return [Tool("multiply", "Multiply two integers.", schema, lambda a, b: a * b)]


def answer_reward(row: Mapping, text: str) -> float:
    """1.0 iff ``text`` (a final turn) is an integer, surrounding whitespace (and a stop token
    left in the text) aside, equal to ``row["answer"]``."""
    for stop in SPECIALS:
        text = text.replace(stop, "")
    found = re.fullmatch(r"\s*([+-]?\d+)\s*", text)
    return float(found is not None and int(found.group(1)) == int(row["answer"]))


def make_environment(task: AgentTask) -> ToolEnvironment:
    """A fresh environment, for one trajectory."""
    return ToolEnvironment(
        tools(task), fmt="hermes", answer_reward=answer_reward, max_turns=task.max_turns
    )


def tool_call_text(a: int, b: int) -> str:
    """The teacher's call: compact JSON (no spaces) so it is a few tokens."""
    body = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def teacher_turns(row: Mapping, use_tool: bool) -> list[str]:
    """The teacher's assistant turns: a call then the tool's result, or the product directly."""
    return [tool_call_text(row["a"], row["b"]), "{result}"] if use_tool else [row["answer"]]


def chat_format(task: AgentTask, tokenizer: TextTokenizer) -> ChatFormat:
    """How a rollout renders this task's conversations (the tools in the system turn)."""
    return ChatFormat(tokenizer, tools=[t.schema() for t in tools(task)])


def encode_transcript(
    task: AgentTask, chat: ChatFormat, row: Mapping, turns: list[str]
) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of a conversation as a multi-turn rollout builds it: the prompt, each
    turn's tokens and stop token (loss 1), and after a turn that called the tool the observation of
    a real ``ToolEnvironment`` step (loss 0). ``"{result}"`` in a turn is the last tool result."""
    tok, env = chat.tokenizer, make_environment(task)
    ids = chat.prompt_ids(env.reset(row))
    mask = [0] * len(ids)
    result = ""
    for text in turns:
        text = text.replace("{result}", result)
        turn = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        step = env.step(Action(text, tuple(turn)))
        if step.done:
            break
        obs = chat.observation_ids(step.observation)
        ids, mask = ids + obs, mask + [0] * len(obs)
        result = step.observation[-1]["content"]
    return ids, mask


def _corpus(task: AgentTask, rows: list[dict]) -> list[str]:
    """The text of tool-using teacher conversations (their pieces cover the direct answers' too),
    special tokens cut out."""
    schemas = [t.schema() for t in tools(task)]
    cut = re.compile("|".join(re.escape(s) for s in SPECIALS + TOOL_TOKENS))
    texts = []
    for row in rows:
        product = row["answer"]
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": tool_call_text(row["a"], row["b"])},
            {"role": "tool", "name": "multiply", "content": product},
            {"role": "assistant", "content": product},
        ]
        text = render_chat(CHAT_TEMPLATE, messages, tools=schemas, add_generation_prompt=True)
        texts += [piece for piece in cut.split(text) if piece]
    return texts


def build_tokenizer(task: AgentTask, directory: Path) -> TextTokenizer:
    """A byte-level BPE (digits always single tokens) trained on the task's conversations, written
    as a Hugging Face directory ``directory / "tokenizer"`` with the ChatML template, and loaded."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=task.vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    train, _ = make_splits(task)
    tok.train_from_iterator(_corpus(task, train[:500]), trainer)
    tok.add_tokens(TOOL_TOKENS)
    out = directory / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return load_tokenizer(out)


def max_positions(task: AgentTask) -> int:
    """The base model's positions, prompt and trajectory together: 256, or 64 per turn if more."""
    return max(256, 64 * task.max_turns)


def model_config(task: AgentTask, tokenizer: TextTokenizer) -> ModelConfig:
    """The tiny Llama; 256 positions hold a ``max_turns``-turn conversation with room to spare."""
    return tiny_llama(
        tokenizer,
        hidden_size=task.hidden_size,
        num_layers=task.num_layers,
        max_positions=max_positions(task),
    )


def pad_transcripts(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[np.ndarray, ...]:
    """``(ids, mask, loss_mask)`` ``[n, T]``, right-padded to a multiple of 16 (``loss_mask[t]``:
    ``ids[t]`` is a target, as ``relax.tasks.base.nll`` reads it)."""
    length = -(-max(len(ids) for ids, _ in rows) // 16) * 16
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask, loss_mask = np.zeros_like(ids), np.zeros_like(ids)
    for r, (row_ids, row_loss) in enumerate(rows):
        ids[r, : len(row_ids)], mask[r, : len(row_ids)], loss_mask[r, : len(row_ids)] = (
            row_ids,
            1,
            row_loss,
        )
    return ids, mask, loss_mask


def train_base_model(
    task: AgentTask,
    tokenizer: TextTokenizer,
    train: list[dict],
    *,
    key: jax.Array,
    log=print,
    config: ModelConfig | None = None,
) -> Transformer:
    """The supervised phase: imitate the noisy teacher's transcripts (``encode_transcript``; the
    token-mean NLL of the assistant turns), a fresh coin per row and step for calling the tool.
    ``config``: the model's shape (default ``model_config``'s), e.g. a vocabulary padded to
    split over a mesh."""
    chat = chat_format(task, tokenizer)
    transcript = functools.cache(
        lambda i, use_tool: encode_transcript(
            task, chat, train[i], teacher_turns(train[i], use_tool)
        )
    )

    def sample(rng: np.random.Generator):
        idx = rng.choice(len(train), task.sft_batch, replace=False)
        flips = rng.random(task.sft_batch) < task.tool_rate
        return pad_transcripts(
            [transcript(int(j), bool(f)) for j, f in zip(idx, flips)], tokenizer.pad_token_id
        )

    return supervised_loop(
        config or model_config(task, tokenizer),
        sample,
        steps=task.sft_steps,
        learning_rate=task.sft_learning_rate,
        seed=task.seed,
        key=key,
        log=log,
    )
