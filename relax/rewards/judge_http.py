"""A judge behind an OpenAI-compatible HTTP endpoint (``--judge.url``): chat completions.

``ChatClient(url, ...).complete(conversations)`` POSTs one request per conversation to
``<url>/chat/completions`` (``url`` as given when it already ends so), at most ``concurrency`` in
flight (a thread pool over one ``httpx.Client``), each with ``timeout_s`` seconds and up to
``retries`` more tries after a transport error, a timeout, HTTP 429 or 5xx, waiting
``backoff_s * 2**k`` before try ``k + 1``. The body::

    {"model": model, "messages": [...], "max_tokens": max_new_tokens, "temperature": temperature}

and the reply's ``choices[0].message.content`` is the judge's text. A request that still fails
(or a reply without that field) gives a ``Failure`` naming why, in its place: the judge counts it
and applies the run's ``--reward-on-error`` rule. The API key, when set, goes as
``Authorization: Bearer <key>``. ``httpx`` (the ``serve`` extra) is imported here, lazily: the
judge imports this module only when given a URL.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatClient", "Failure"]

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclasses.dataclass(frozen=True)
class Failure:
    """A request that failed after its retries: ``why`` (the last error) and ``tries``."""

    why: str
    tries: int


def endpoint(url: str) -> str:
    """``url`` with ``/chat/completions`` appended unless it already ends so."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else f"{url}/chat/completions"


class ChatClient:
    """Chat completions against ``url`` (module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        api_key: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        concurrency: int = 8,
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 1.0,
    ):
        try:
            import httpx
        except ImportError as e:  # pragma: no cover - the serve extra is missing
            raise ImportError(
                "--judge.url needs httpx: pip install 'relax[serve]' (or pip install httpx)"
            ) from e
        if concurrency < 1 or retries < 0 or not timeout_s > 0 or backoff_s < 0:
            raise ValueError(
                f"judge HTTP settings: concurrency {concurrency} (>= 1), retries {retries} (>= 0), "
                f"timeout_s {timeout_s} (> 0), backoff_s {backoff_s} (>= 0)"
            )
        self.url, self.model = endpoint(url), model
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency),
        )

    def time_bound_s(self, n: int) -> float:
        """The longest ``complete`` of ``n`` conversations can take: every request at its timeout
        on every try, ``concurrency`` at a time, with the backoffs between tries."""
        waves = -(-n // self.concurrency)
        backoffs = sum(self.backoff_s * 2**k for k in range(self.retries))
        return waves * ((self.retries + 1) * self.timeout_s + backoffs)

    def complete(self, conversations: Sequence[Sequence[Mapping[str, Any]]]) -> list[str | Failure]:
        """The judge's reply to each conversation (a list of chat messages), in order; a
        ``Failure`` where a request failed after its retries."""
        if not conversations:
            return []
        workers = min(self.concurrency, len(conversations))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="judge") as ex:
            return list(ex.map(self._one, conversations))

    def _one(self, messages: Sequence[Mapping[str, Any]]) -> str | Failure:
        body = {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
        }
        why = ""
        for k in range(self.retries + 1):
            if k:
                time.sleep(self.backoff_s * 2 ** (k - 1))
            try:
                r = self._client.post(self.url, json=body)
            except self._httpx.HTTPError as e:  # timeouts and transport errors
                why = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in RETRY_STATUS:
                why = f"HTTP {r.status_code}"
                continue
            if r.status_code != 200:
                return Failure(f"HTTP {r.status_code}: {r.text[:200]}", k + 1)
            try:
                content = r.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                return Failure(f"reply without choices[0].message.content: {r.text[:200]}", k + 1)
            if not isinstance(content, str):
                return Failure(f"choices[0].message.content is {type(content).__name__}", k + 1)
            return content
        return Failure(why, self.retries + 1)

    def close(self) -> None:
        self._client.close()
