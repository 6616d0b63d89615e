"""What the server checks of a request before anything of it runs: that it comes from where it may
(``Host``, ``Origin``, the token, the content type) and that its body fits (``--max-body-mb``) in
what every request in flight may hold together (``--max-inflight-mb``).

    guard = Guard(token, hosts=("127.0.0.1", "localhost", "::1"))
    refusal = guard.refusal(request.method, request.headers)      # (status, message) or None
    hold = Budget(limit).hold()                                   # released when the request ends
    body = await read_body(request, max_body, hold)               # RequestError 413 / 429

Same-origin: a web page in the user's browser can send a POST to ``127.0.0.1`` without asking
(a "simple" request: ``text/plain``, or no content type), and through DNS rebinding (its own name
made to resolve to ``127.0.0.1``) even read the answer. So a request must name one of the
server's own host names in ``Host`` (rebinding sends the attacker's name), must not carry an
``Origin`` other than the server's own (``http://`` + its ``Host``), nor ``Sec-Fetch-Site:
cross-site``, and a ``POST`` must be ``application/msgpack``, a type a page cannot send without a
CORS preflight, which this server never answers.

The in-flight budget: a body of ``n`` bytes holds ``n`` while it is received (chunk by chunk; at
once when ``Content-Length`` says it), ``2n`` more while it is decoded (its arrays, and one bin's
bytes at a time), ``wire.VALUE_BYTES`` per decoded value, and ``n`` plus its values until its
operation has run. A request that would take the budget over its limit is refused: 429 (try
again) when the others hold it, 413 when it alone is too large.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.requests import Request

from relax.serve.wire import RequestError

__all__ = [
    "MEDIA_TYPE",
    "Budget",
    "Guard",
    "Hold",
    "host_name",
    "read_body",
]

MEDIA_TYPE = "application/msgpack"
MiB = 1 << 20


def host_name(host: str) -> str:
    """The name of a ``Host`` header's value, lower-case, without its port (``[::1]:8470`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


class Guard:
    """The checks on a request's origin (module docstring). ``hosts``: the names its ``Host`` may
    give (``"*"``: any); ``token``: the one its ``Authorization: Bearer`` must carry (None: none)."""

    def __init__(self, token: str | None, hosts: Iterable[str]):
        self.token, self.hosts = token, frozenset(h.lower() for h in hosts)

    def refusal(self, method: str, headers: Headers) -> tuple[int, str] | None:
        """``(status, message)`` for a request refused on its headers alone; None: it may go on."""
        host = headers.get("host")
        if host is None or ("*" not in self.hosts and host_name(host) not in self.hosts):
            return 403, (
                f"Host {host!r:.80} is not a name of this server ({', '.join(sorted(self.hosts))}); "
                "a remote server's names are given with --allowed-hosts"
            )
        origin = headers.get("origin")
        own = (f"http://{host.lower()}", f"https://{host.lower()}")
        if origin is not None and origin.lower() not in own:
            return 403, f"cross-origin request refused (Origin {origin!r:.80})"
        if headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return (
                403,
                f"cross-site request refused (Sec-Fetch-Site {headers['sec-fetch-site']!r:.40})",
            )
        if self.token is not None:
            sent = headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {self.token}".encode()):
                return 401, "a valid 'Authorization: Bearer <token>' header is needed"
        if method == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != MEDIA_TYPE:
                return 415, f"a body must be {MEDIA_TYPE}, got {kind or 'no content type'!r:.60}"
        return None


class Budget:
    """Bytes that every request in flight may hold together (module docstring); thread-safe."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def hold(self) -> Hold:
        return Hold(self)


class Hold:
    """One request's share of a ``Budget``: taken as it grows, given back when it ends."""

    def __init__(self, budget: Budget):
        self.budget, self.held = budget, 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes, or raise ``RequestError`` (413 or 429, naming the flag)."""
        b = self.budget
        with b._lock:
            if b.held + n <= b.limit:
                b.held += n
                self.held += n
                return
            others = b.held - self.held
        if self.held + n > b.limit:
            raise RequestError(
                "body",
                f"this request needs {(self.held + n) / MiB:.1f} MiB to receive and decode, over "
                f"the {b.limit / MiB:.0f} MiB of --max-inflight-mb (a body costs ~3x its size "
                "while it is decoded)",
                status=413,
            )
        raise RequestError(
            "body",
            f"the server holds {others / MiB:.1f} MiB of other requests in flight; with this one "
            f"it would pass --max-inflight-mb ({b.limit / MiB:.0f} MiB): try again later",
            status=429,
        )

    def give(self, n: int) -> None:
        n = min(n, self.held)
        with self.budget._lock:
            self.budget.held -= n
            self.held -= n

    def release(self) -> None:
        self.give(self.held)


async def read_body(request: Request, limit: int, hold: Hold) -> bytearray:
    """The body, read chunk by chunk into ``hold``: a 413 as soon as it is over ``limit`` bytes
    (at once when ``Content-Length`` says so), a 429/413 when the budget cannot hold it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError("content-length", f"not a size: {declared!r:.40}")
        if int(declared) > limit:
            raise RequestError(
                "body",
                f"{int(declared)} bytes is over --max-body-mb ({limit / MiB:g} MiB)",
                status=413,
            )
        hold.take(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise RequestError(
                "body", f"the body is over --max-body-mb ({limit / MiB:g} MiB)", status=413
            )
        body += chunk
        if len(body) > hold.held:  # no Content-Length, or more than it said
            hold.take(len(body) - hold.held)
    return body
