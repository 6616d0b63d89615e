"""A generative judge as a reward: a judge model reads each completion and states a score or a
verdict, which ``relax.rewards.judge_parse`` turns into a reward in [0, 1].

    judge = device_judge(JudgeConfig(model="models/judge"), model, tokenizer)
    rewards = judge(prompts, completions, answer=answers)      # TRL's signature

For each sample the judge's prompt is rendered from a jinja2 template (``JudgeConfig.template``:
a string, or a file's path; None: ``DEFAULT_TEMPLATE``, a rubric asking for a final ``Score: N``
or ``Verdict: yes/no`` line) with the variables ``prompt``, ``completion``, ``answer`` (and its
alias ``reference``: the row's ``--answer-field``), ``max_score`` and every other column of the
row; it is the user message of a conversation (after ``system_prompt`` when given). Then either

- ``SamplerBackend``: the judge model on the run's devices (a ``Transformer`` laid out as the
  caller placed it: on a mesh, ``relax.parallel.state_shardings``), with its own tokenizer and
  chat template (``chat``: auto / always / never, as ``--chat-template``), sampling with relax's
  own sampler (``relax.rollout.sampler.compiled_generate``, one completion per prompt, greedy at
  temperature 0). The whole batch is one call: its rows padded to a power of two (at most
  ``batch_size`` rows a call, a multiple of the mesh's batch shards) and its prompts to the
  sampler's length buckets, so one program is compiled per (rows, bucket) shape;
- ``relax.rewards.judge_http.ChatClient``: an OpenAI-compatible endpoint (``url``).

A reply that does not parse, a request that fails and a prompt too long for the judge are a
sample the judge could not score: counted (``judge/unparsed``, ``judge/failed``) and logged, and
with ``on_error="missing"`` a missing reward (None), with ``on_error="raise"`` a ``RewardError``
naming the sample and the reply: the run's ``--reward-on-error`` rule, as ``relax.rewards.functions``
applies it to a whole failing call. ``last_metrics`` holds the last call's ``judge/unparsed``,
``judge/failed``, ``judge/mean_score`` (over the parsed samples) and ``time/judge`` (its wall
seconds); ``judge_metrics(reward_fns)`` collects them for a step's metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from relax.rewards.contract import ON_ERROR, RewardError, RewardFunction, truncate
from relax.rewards.judge_http import Failure
from relax.rewards.judge_parse import DEFAULT_VERDICTS, JudgeParser

__all__ = [
    "DEFAULT_TEMPLATE",
    "GenerativeJudge",
    "JudgeConfig",
    "SamplerBackend",
    "device_judge",
    "http_judge",
    "judge_metrics",
    "load_template",
]

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = """\
You are grading a response to a task.

Task:
{{ prompt }}
{% if answer %}
Reference answer:
{{ answer }}
{% endif %}
Response:
{{ completion }}

Judge whether the response answers the task correctly\
{% if answer %} (it must agree with the reference answer){% endif %}. \
Explain in one or two sentences, then end with a last line of the form \
{% if mode == "verdict" %}"Verdict: yes" or "Verdict: no".\
{% else %}"Score: N", where N is an integer from 0 (wrong) to {{ max_score | int }} (fully correct).\
{% endif %}
"""


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A generative judge reward (``--judge.*``): off unless ``model`` or ``url`` is given."""

    model: str | None = None
    """The judge: a Hugging Face chat model directory run on the run's devices; "policy": the
    policy's own base (--model, or the built-in task's base model)."""
    url: str | None = None
    """Or an OpenAI-compatible endpoint (e.g. http://host:8000/v1): chat completions over HTTP."""
    api_model: str = "judge"
    """--judge.url: the model name sent with each request."""
    api_key_env: str = "OPENAI_API_KEY"
    """--judge.url: the environment variable holding the API key (unset: no key sent)."""
    template: str | None = None
    """The judge's prompt: a jinja2 string (one with a "{" or a line break) or a file's path
    (variables prompt, completion, answer / reference, max_score, mode and every column of the
    row); None: a rubric asking for a final "Score: N" (or "Verdict: yes/no") line."""
    system_prompt: str | None = None
    chat: Literal["auto", "always", "never"] = "auto"
    """--judge.model: render through its chat template (auto: when it has one)."""
    parse: Literal["score", "verdict"] = "score"
    """score: the reward is the number after "Score:" over --judge.max-score; verdict: a word
    looked up in --judge.verdicts."""
    pattern: str | None = None
    """A regex whose first group is read at its last match (None: the mode's default)."""
    max_score: float = 10.0
    verdicts: tuple[str, ...] = DEFAULT_VERDICTS
    """verdict mode: word=reward pairs (case-insensitive)."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    """0: greedy."""
    weight: float = 1.0
    batch_size: int = 256
    """--judge.model: at most this many samples per sampler call."""
    max_prompt_tokens: int = 2048
    """--judge.model: a longer judge prompt is a sample the judge could not score (counted)."""
    concurrency: int = 8
    """--judge.url: requests in flight."""
    timeout_s: float = 60.0
    """--judge.url: seconds per request."""
    retries: int = 2
    """--judge.url: more tries after a timeout, a transport error, HTTP 429 or 5xx."""
    backoff_s: float = 1.0
    """--judge.url: seconds before the second try, doubled before each next one."""

    def __post_init__(self):
        if self.model is not None and self.url is not None:
            raise ValueError("--judge.model and --judge.url are exclusive: give one judge")
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--judge.{name.replace('_', '-')} must be >= 1")
        if self.temperature < 0 or self.retries < 0 or self.backoff_s < 0 or not self.timeout_s > 0:
            raise ValueError(
                "--judge.temperature, --judge.retries and --judge.backoff-s must be >= 0, "
                "--judge.timeout-s > 0"
            )
        self.parser()  # a bad pattern, max score or verdict list fails here, before any load

    @property
    def enabled(self) -> bool:
        return self.model is not None or self.url is not None

    def parser(self) -> JudgeParser:
        return JudgeParser(self.parse, self.pattern, self.max_score, self.verdicts)


def load_template(template: str | None):
    """The compiled jinja2 template: ``template`` read from a file when it names one, else the
    string itself; None: ``DEFAULT_TEMPLATE``. Undefined variables raise (naming them)."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = DEFAULT_TEMPLATE if template is None else template
    if template is not None and "\n" not in template and "{" not in template:
        path = Path(template)
        if not path.is_file():
            raise FileNotFoundError(f"--judge.template {template!r}: no such file")
        source = path.read_text()
    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=False)
    return env.from_string(source)


def _text(prompt: Any) -> str:
    """A prompt as text: a string as it is, chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)


class GenerativeJudge:
    """The judge reward (module docstring): ``judge(prompts, completions, **fields)``."""

    __name__ = "judge"

    def __init__(
        self,
        backend,
        parser: JudgeParser,
        *,
        template: str | None = None,
        system_prompt: str | None = None,
        answer_field: str = "answer",
        on_error: str = "raise",
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.backend, self.parser, self.on_error = backend, parser, on_error
        self.template, self.system_prompt = load_template(template), system_prompt
        self.answer_field = answer_field
        self.last_metrics: dict[str, float] = {}
        self._memo: dict[str, str | Failure] = {}  # the last batch's replies

    def conversation(self, prompt: Any, completion: str, row: Mapping[str, Any]) -> list[dict]:
        """The judge's messages for one sample (``row``: its other columns)."""
        answer = row.get(self.answer_field)
        text = self.template.render(
            {
                **row,
                "prompt": _text(prompt),
                "completion": completion,
                "answer": answer,
                "reference": answer,
                "max_score": self.parser.max_score,
                "mode": self.parser.mode,
            }
        )
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": text}]

    def replies(self, conversations: list[list[dict]]) -> list[str | Failure]:
        """The backend's replies; those of the last batch are remembered, so that re-scoring one
        of its samples alone (``relax.rewards.functions`` does, to name a raising sample) asks
        the judge nothing. Identical conversations (a group's equal completions) are asked once."""
        keys = [repr(c) for c in conversations]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}  # each key's first sample
        todo = [i for i, k in enumerate(keys) if first[k] == i and k not in self._memo]
        fresh = self.backend.complete([conversations[i] for i in todo]) if todo else []
        got = dict(zip((keys[i] for i in todo), fresh))
        out = [got[k] if k in got else self._memo[k] for k in keys]
        if len(conversations) > 1:
            self._memo = dict(zip(keys, out))
        return out

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **fields) -> list:
        t0 = time.perf_counter()
        rows = [{k: v[i] for k, v in fields.items()} for i in range(len(prompts))]
        convs = [self.conversation(p, c, r) for p, c, r in zip(prompts, completions, rows)]
        replies = self.replies(convs)
        scores = [None if isinstance(r, Failure) else self.parser(r) for r in replies]
        failed = [i for i, r in enumerate(replies) if isinstance(r, Failure)]
        unparsed = [
            i for i, (r, s) in enumerate(zip(replies, scores)) if s is None and isinstance(r, str)
        ]
        parsed = [s for s in scores if s is not None]
        self.last_metrics = {
            "judge/unparsed": float(len(unparsed)),
            "judge/failed": float(len(failed)),
            "judge/mean_score": float(np.mean(parsed)) if parsed else float("nan"),
            "time/judge": time.perf_counter() - t0,
        }
        bad = sorted(failed + unparsed)
        if bad:
            i = bad[0]
            what = (
                f"failed ({replies[i].why}, {replies[i].tries} tries)"
                if isinstance(replies[i], Failure)
                else f"reply could not be read as a {self.parser.mode} ({truncate(replies[i])!r})"
            )
            if self.on_error == "raise":
                raise RewardError(
                    f"judge: sample {i} {what} (completion={truncate(completions[i])!r}); "
                    f"{len(unparsed)} unparsed and {len(failed)} failed of {len(prompts)}"
                )
            logger.warning(
                "judge: %d unparsed and %d failed of %d samples count as missing; first: sample %d %s",
                len(unparsed),
                len(failed),
                len(prompts),
                i,
                what,
            )
        return scores

    def time_bound_s(self, fields: Mapping[str, Sequence[Any]]) -> float | None:
        """The longest a call on the rows ``fields`` may take (``relax.rewards.contract.call_timeout_s``):
        the HTTP backend's worst case; None (the run's timeout) for the sampler."""
        bound = getattr(self.backend, "time_bound_s", None)
        n = len(next(iter(fields.values()), ()))
        return None if bound is None or n == 0 else bound(n)


class SamplerBackend:
    """The judge model on the devices its weights are on, sampling with relax's sampler (module
    docstring): ``complete(conversations) -> [reply text or Failure]``."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        chat: str = "auto",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        batch_size: int = 256,
        max_prompt_tokens: int = 2048,
        seed: int = 0,
    ):
        import jax

        from relax.models.config.sharding import batch_shards, mesh_of
        from relax.rollout.sampler import RolloutConfig, compiled_generate
        from relax.rollout.sampling import SamplingConfig

        if chat not in ("auto", "always", "never"):
            raise ValueError(f"chat must be auto, always or never, got {chat!r}")
        if chat == "always" and not tokenizer.has_chat_template:
            raise ValueError(f"--judge.chat always: {tokenizer.path} has no chat template")
        self.model, self.tokenizer = model, tokenizer
        self.chat = tokenizer.has_chat_template and chat != "never"
        eos = tuple(sorted({*model.config.eos_ids, *tokenizer.eos_token_ids}))
        self.rollout = RolloutConfig(
            num_generations=1,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=temperature),
            eos_ids=eos,
            pad_id=tokenizer.pad_token_id,
        )
        self.mesh = mesh_of(model)
        self.shards = 1 if self.mesh is None else batch_shards(self.mesh)
        self.batch_size = -(-batch_size // self.shards) * self.shards
        context = model.config.max_position_embeddings - max_new_tokens
        self.max_prompt_tokens = min(max_prompt_tokens, context)
        self.key, self.calls = jax.random.key(seed), 0
        self._generate = compiled_generate(self.rollout)

    def encode(self, messages: list[dict]) -> list[int]:
        """The judge's prompt tokens: through its chat template (with the generation prompt), or
        the messages' contents joined by blank lines with the tokenizer's special tokens."""
        tok = self.tokenizer
        if self.chat:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=True)

    def rows(self, n: int) -> int:
        """Rows of a call for ``n`` samples: the next power of two, at most ``batch_size``, a
        multiple of the mesh's batch shards."""
        rows = min(1 << max(0, n - 1).bit_length(), self.batch_size)
        return -(-rows // self.shards) * self.shards

    def complete(self, conversations: Sequence[list[dict]]) -> list[str | Failure]:
        encoded = [self.encode(c) for c in conversations]
        out: list[str | Failure] = [
            Failure(
                f"judge prompt of {len(ids)} tokens: over {self.max_prompt_tokens} (the "
                "judge's --judge.max-prompt-tokens, or its context less --judge.max-new-tokens)",
                0,
            )
            for ids in encoded
        ]
        ok = [i for i, ids in enumerate(encoded) if 0 < len(ids) <= self.max_prompt_tokens]
        for start in range(0, len(ok), self.batch_size):
            idx = ok[start : start + self.batch_size]
            texts = self._sample([encoded[i] for i in idx])
            for i, t in zip(idx, texts):
                out[i] = t
        return out

    def _sample(self, rows: list[list[int]]) -> list[str]:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from relax.models.config.sharding import BATCH_AXES
        from relax.rollout.config import DEFAULT_BUCKETS
        from relax.text.sentencepiece_model import pad_left

        n = len(rows)
        padded = rows + [rows[-1]] * (self.rows(n) - n)
        ids, mask = pad_left(padded, pad_id=self.rollout.pad_id, bucket_sizes=DEFAULT_BUCKETS)
        key = self.key
        if self.rollout.sampling.temperature > 0:
            key, self.calls = jax.random.fold_in(self.key, self.calls), self.calls + 1
        if self.mesh is None:
            r = self._generate(self.model, ids, mask, key)
        else:
            axes = tuple(a for a in BATCH_AXES if a in self.mesh.axis_names)
            split = NamedSharding(self.mesh, PartitionSpec(axes))
            ids, mask = jax.device_put(ids, split), jax.device_put(mask, split)
            key = jax.device_put(key, NamedSharding(self.mesh, PartitionSpec()))
            with jax.set_mesh(self.mesh):
                r = self._generate(self.model, ids, mask, key)
        tokens, tmask = np.asarray(r.tokens)[:n, 0], np.asarray(r.mask)[:n, 0]
        return self.tokenizer.decode_batch(tokens, tmask, skip_special_tokens=True)


def device_judge(
    cfg: JudgeConfig,
    model,
    tokenizer,
    *,
    answer_field: str = "answer",
    on_error: str = "raise",
    seed: int = 0,
) -> GenerativeJudge:
    """The judge reward of ``cfg`` on the judge ``model`` (a ``Transformer``, placed where it is
    to run) with its ``tokenizer``."""
    backend = SamplerBackend(
        model,
        tokenizer,
        chat=cfg.chat,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        batch_size=cfg.batch_size,
        max_prompt_tokens=cfg.max_prompt_tokens,
        seed=seed,
    )
    return _judge(cfg, backend, answer_field, on_error)


def http_judge(
    cfg: JudgeConfig, *, answer_field: str = "answer", on_error: str = "raise"
) -> GenerativeJudge:
    """The judge reward of ``cfg`` against its ``url`` (``relax.rewards.judge_http``); the API key
    from the environment variable ``cfg.api_key_env``."""
    from relax.rewards.judge_http import ChatClient

    if cfg.url is None:
        raise ValueError("http_judge needs --judge.url")
    client = ChatClient(
        cfg.url,
        model=cfg.api_model,
        api_key=os.environ.get(cfg.api_key_env),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        concurrency=cfg.concurrency,
        timeout_s=cfg.timeout_s,
        retries=cfg.retries,
        backoff_s=cfg.backoff_s,
    )
    return _judge(cfg, client, answer_field, on_error)


def _judge(cfg: JudgeConfig, backend, answer_field: str, on_error: str) -> GenerativeJudge:
    return GenerativeJudge(
        backend,
        cfg.parser(),
        template=cfg.template,
        system_prompt=cfg.system_prompt,
        answer_field=answer_field,
        on_error=on_error,
    )


def judge_metrics(reward_fns: Sequence[Any]) -> dict[str, float]:
    """The last call's ``last_metrics`` of every generative judge among ``reward_fns``
    (``RewardFunction``s or callables), for a step's metrics."""
    out: dict[str, float] = {}
    for f in reward_fns:
        fn = f.fn if isinstance(f, RewardFunction) else f
        if isinstance(fn, GenerativeJudge):
            out.update(fn.last_metrics)
    return out
