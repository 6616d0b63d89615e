"""The training service over HTTP: a Starlette app on uvicorn, msgpack bodies.

    python -m relax.serve --model HF_DIR --lora.rank 16            # 127.0.0.1:8470
    python -m relax.serve                                          # the built-in task's base model
    python -m relax.serve --model HF_DIR --host 0.0.0.0 --allow-remote --token-file TOKEN

Routes (``POST`` bodies and every response are msgpack maps, ``relax.serve.wire``):

=========================================  ======================================================
``GET  /v1/info``                          the model, its vocabulary, the losses served
``GET  /v1/tokenizer``                     the tokenizer's files
``POST /v1/sessions``                      a new session (``rank``, ``seed``, LoRA options)
``POST /v1/sessions/from_state``           a new session from a ``save_state`` path
``POST /v1/sessions/{id}/<op>``            ``forward_backward``, ``forward``, ``optim_step``,
                                           ``save_state``, ``load_state``, ``save_weights``,
                                           ``save_weights_for_sampler``, ``close``
``POST /v1/sample``                        completions from ``model_path`` (a sampler snapshot)
=========================================  ======================================================

Order: one worker thread runs every request, in the order the requests arrived (their bodies
read in full); nothing runs concurrently with anything else. A session's state and randomness are
its own, so what a session computes depends only on its own requests, whatever other clients do.
A request that arrived runs to its end even if its client disconnects; its result is dropped.

Errors: a refused request is ``400 {"error", "field"}`` naming the field (413 over a size limit,
429 over a count or the in-flight budget), an unknown session ``404``, a missing or wrong token
``401``, a foreign ``Host`` or ``Origin`` ``403``, a body not ``application/msgpack`` ``415``,
anything else ``500 {"error"}`` (logged with its traceback); none of them changes a session
(``relax.serve.session``).

Security (``relax.serve.guard``, ``relax.serve.tokens``): the server binds to ``--host``
(127.0.0.1 by default); any other host is refused unless ``--allow-remote`` is given, which also
needs the user's token (``--token-file`` or ``RELAX_SERVE_TOKEN``). Without one, a local server
generates a token at start-up into ``~/.relax/serve-<port>.token`` (mode 0600), which the client
on the same machine reads by itself. Every request must carry ``Authorization: Bearer <token>``,
name one of the server's own hosts in ``Host`` and no other origin in ``Origin``; every ``POST``
body is msgpack, never pickle, streamed against ``--max-body-mb`` and ``--max-inflight-mb``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from relax.models.layers.lora import LoRAConfig
from relax.parallel.step import ParallelConfig
from relax.serve.guard import MEDIA_TYPE, Budget, Guard, read_body
from relax.serve.limits import ServiceLimits
from relax.serve.service import Service, ServiceConfig, UnknownSession
from relax.serve.tokens import LOCAL_HOSTS, check_token
from relax.serve.wire import RequestError, decode_request, to_msgpack
from relax.train.free_memory import host_free

__all__ = [
    "MEDIA_TYPE",
    "NotFound",
    "ServeConfig",
    "allowed_hosts",
    "check_binding",
    "check_parallel",
    "inflight_mb",
    "load_service",
    "make_app",
    "read_token",
    "resolve",
    "run",
]

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
SESSION_OPS = (
    "forward_backward",
    "forward",
    "optim_step",
    "save_state",
    "load_state",
    "save_weights",
    "save_weights_for_sampler",
    "close",
)
log = logging.getLogger("relax.serve")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """``python -m relax.serve``'s flags."""

    model: str | None = None
    """A Hugging Face model directory (with its tokenizer); None: the built-in reverse task's base
    model, made in ``<state-dir>/builtin`` on first use."""
    lora: LoRAConfig = LoRAConfig(rank=8)
    """A new session's adapters (a client may choose another rank); rank 0 trains every weight."""
    dtype: str = "float32"
    """The model's compute and parameter dtype (``bfloat16`` for large models)."""
    parallel: ParallelConfig = ParallelConfig()
    """``--parallel.mesh``: the model and every session's state laid out on a mesh of this process's
    devices (e.g. ``fsdp=-1``); the other ``--parallel.*`` options are not served (an error)."""
    host: str = "127.0.0.1"
    port: int = 8470
    allow_remote: bool = False
    """Permit a ``--host`` other than localhost (``--host`` sets the address; needs a token)."""
    allowed_hosts: tuple[str, ...] = ()
    """Names a request's ``Host`` may give besides localhost's and ``--host`` (the names remote
    clients reach the server by; ``*``: any, the token then the only guard)."""
    token_file: str | None = None
    """A file holding the token clients must send (else ``RELAX_SERVE_TOKEN``; neither: a local
    server generates one into ``~/.relax/serve-<port>.token``, which local clients read)."""
    state_dir: str = "runs/serve"
    """Where ``save_state`` and ``save_weights`` write (and ``load_state`` reads)."""
    samplers_kept: int = 4
    """Each session keeps its newest this many sampler snapshots in memory (older ones are dropped,
    counted; sampling from one is an error saying so)."""
    max_body_mb: int = 1024
    """A request body larger than this is refused (413) as soon as it is seen to be."""
    max_inflight_mb: int | None = None
    """What every request's body in flight may hold together, received, decoded and waiting for
    the worker (~3x its size while decoded; ``relax.serve.guard``); over it, 429. None: a quarter
    of the memory free once the model is loaded (the host's, the process's cgroup's,
    ``--limits.memory-mb``): the rest is for the sessions, compiled programs and responses."""
    limits: ServiceLimits = ServiceLimits()
    """What one request and every session together may cost (``relax.serve.limits``)."""


def read_token(cfg: ServeConfig) -> str | None:
    """The user's token (``--token-file``, else ``RELAX_SERVE_TOKEN``), checked: a blank, short or
    whitespace-holding one is a ``ValueError``. None: no token given."""
    if cfg.token_file is not None:
        return check_token(Path(cfg.token_file).read_text().strip(), cfg.token_file)
    if "RELAX_SERVE_TOKEN" in os.environ:
        return check_token(os.environ["RELAX_SERVE_TOKEN"], "RELAX_SERVE_TOKEN")
    return None


def allowed_hosts(cfg: ServeConfig) -> tuple[str, ...]:
    """The names a request's ``Host`` may give: localhost's, ``--host`` (for a wildcard one, the
    machine's name and addresses as far as it knows them) and ``--allowed-hosts``."""
    names = [*LOCAL_HOSTS, *cfg.allowed_hosts]
    if cfg.host not in WILDCARD_HOSTS:
        names.append(cfg.host)
    else:
        names += [socket.gethostname(), socket.getfqdn()]
        with contextlib.suppress(OSError):
            names += socket.gethostbyname_ex(socket.gethostname())[2]
    return tuple(dict.fromkeys(n.lower() for n in names))


def inflight_mb(cfg: ServeConfig) -> int:
    """``--max-inflight-mb``, or its default: a quarter of the memory the process has free now
    (``relax.train.free_memory.host_free``: the host's, its cgroup's, ``--limits.memory-mb``)."""
    if cfg.max_inflight_mb is not None:
        return cfg.max_inflight_mb
    return host_free(cfg.limits.memory_mb)[0] // 4 >> 20


def check_parallel(cfg: ServeConfig) -> None:
    """The service runs on one process's devices, one mesh: the other ``--parallel.*`` are refused."""
    p, default = cfg.parallel, ParallelConfig()
    unserved = [
        f.name
        for f in dataclasses.fields(p)
        if f.name != "mesh" and getattr(p, f.name) != getattr(default, f.name)
    ]
    if unserved:
        raise ValueError(
            f"the service does not serve --parallel.{unserved[0].replace('_', '-')}: it runs on one "
            "process's devices with one mesh (--parallel.mesh); one server process holds every "
            "session, and serving over several processes (each running every request, in order) "
            "is not built"
        )


def check_binding(cfg: ServeConfig, token: str | None) -> None:
    """Only localhost without ``--allow-remote``; a remote binding only with a token; positive
    body limits."""
    if cfg.host not in LOCAL_HOSTS and not cfg.allow_remote:
        raise ValueError(
            f"--host {cfg.host} serves beyond this machine: pass --allow-remote (and a token) "
            f"to do that on purpose; the default is 127.0.0.1"
        )
    if cfg.allow_remote and token is None:
        raise ValueError("--allow-remote needs a token: --token-file FILE or RELAX_SERVE_TOKEN")
    for flag, value in (
        ("--max-body-mb", cfg.max_body_mb),
        ("--max-inflight-mb", cfg.max_inflight_mb),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be a positive number of MiB, got {value}")


def load_service(cfg: ServeConfig) -> Service:
    """The model (``cfg.model`` or the built-in task's) and its tokenizer, served."""
    import jax.numpy as jnp

    from relax.models.decoder.transformer import cast
    from relax.models.hf.checkpoint import load_pretrained
    from relax.text import load_tokenizer

    dtype = jnp.dtype(cfg.dtype)
    if cfg.model is None:
        from relax.tasks import TASKS
        from relax.tasks.base import prepare
        from relax.tasks.reverse import ReverseTask

        tokenizer, base, _, _ = prepare(
            TASKS["reverse"],
            ReverseTask(),
            Path(cfg.state_dir) / "builtin",
            seed=0,
            teacher="a noisy teacher of the reverse task",
            log=log.info,
        )
        name = str(Path(cfg.state_dir, "builtin", "base_model").resolve())
        base = cast(base, dtype=dtype)  # as load_pretrained(dtype=): parameters as stored
    else:
        name = cfg.model
        base = load_pretrained(cfg.model, dtype=dtype)
        try:
            tokenizer = load_tokenizer(cfg.model)
        except FileNotFoundError as e:  # weights only: clients bring token ids
            log.warning("no tokenizer served (get_tokenizer will fail): %s", e)
            tokenizer = None
    return Service(
        base,
        tokenizer,
        ServiceConfig(
            model=name,
            state_dir=cfg.state_dir,
            lora=cfg.lora,
            mesh=cfg.parallel.mesh,
            samplers_kept=cfg.samplers_kept,
            limits=cfg.limits,
        ),
    )


def _reply(obj, status: int = 200, *, close: bool = False) -> Response:
    """A msgpack reply; ``close``: the connection closed after it (a body left unread is not
    drained: its sender learns at once)."""
    headers = {"retry-after": "1"} if status == 429 else {}
    if close:
        headers["connection"] = "close"
    return Response(to_msgpack(obj), status_code=status, media_type=MEDIA_TYPE, headers=headers)


class NotFound(LookupError):
    pass


def resolve(service: Service, method: str, path: str, body: dict):
    """The operation a request names, bound to its arguments: a function of no arguments that
    runs it (on the worker thread). ``NotFound`` for a path the service does not have."""
    parts = path.strip("/").split("/")
    if parts[:1] != ["v1"]:
        raise NotFound(path)
    parts = parts[1:]
    if method == "GET" and parts in (["info"], ["tokenizer"]):
        return service.info if parts == ["info"] else service.tokenizer_files
    if method != "POST":
        raise NotFound(path)
    if parts == ["sessions"]:
        return functools.partial(service.create_session, body)
    if parts == ["sessions", "from_state"]:
        return functools.partial(service.create_session_from_state, body)
    if parts == ["sample"]:
        return functools.partial(service.sample, body)
    if len(parts) == 3 and parts[0] == "sessions" and parts[2] in SESSION_OPS:
        sid, op = parts[1], parts[2]
        if op == "close":
            return functools.partial(service.close_session, sid)
        if op == "forward":
            return functools.partial(service.forward_backward, sid, body, backward=False)
        return functools.partial(getattr(service, op), sid, body)
    raise NotFound(path)


def run(call):
    """``call()``'s reply: ``(status, body)`` (module docstring's errors)."""
    try:
        return 200, call()
    except RequestError as e:
        return e.status, {"error": str(e), "field": e.field}
    except UnknownSession as e:
        return 404, {
            "error": f"no session {e.args[0]!r} (closed, or from before a restart: "
            "create_training_client_from_state)",
            "field": "session",
        }
    except Exception as e:
        log.exception("request failed")
        return 500, {"error": f"{type(e).__name__}: {e}"}


def make_app(
    service: Service,
    token: str | None = None,
    *,
    max_body_mb: int = 1024,
    max_inflight_mb: int | None = None,
    hosts: Iterable[str] = LOCAL_HOSTS,
) -> Starlette:
    """The app: every request checked by ``guard`` (``token``: None, none needed; ``hosts``: the
    names ``Host`` may give), its body held within the in-flight budget (None: a quarter of the
    memory; ``inflight_mb``) until it has run; every operation on one worker thread, in arrival
    order (module docstring)."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-serve")
    guard = Guard(token, hosts)
    if max_inflight_mb is None:
        max_inflight_mb = inflight_mb(ServeConfig())
    budget = Budget(max_inflight_mb << 20)
    running: set[asyncio.Task] = set()  # shielded requests whose client may have left

    async def respond(request: Request) -> Response:
        hold, unread = budget.hold(), request.method == "POST"
        try:
            payload = {}
            if request.method == "POST":
                body = await read_body(request, max_body_mb << 20, hold)
                unread = False
                hold.take(2 * len(body))  # its arrays, and one bin's bytes at a time
                payload = await asyncio.to_thread(decode_request, body, charge=hold.take)
                hold.give(2 * len(body))
                del body
            call = resolve(service, request.method, request.url.path, payload)
            status, out = await asyncio.wrap_future(worker.submit(run, call))
            return _reply(out, status)
        except RequestError as e:
            return _reply({"error": str(e), "field": e.field}, e.status, close=unread)
        except ClientDisconnect:
            return _reply({"error": "the client left before its body was sent"}, 400, close=True)
        except Exception as e:  # a bug of the HTTP layer's own: as run's
            log.exception("request failed")
            return _reply({"error": f"{type(e).__name__}: {e}"}, 500, close=unread)
        finally:
            hold.release()

    async def handle(request: Request) -> Response:
        refused, post = guard.refusal(request.method, request.headers), request.method == "POST"
        if refused is not None:
            return _reply({"error": refused[1]}, refused[0], close=post)
        try:
            resolve(service, request.method, request.url.path, {})  # the route, before its body
        except NotFound:
            return _reply(
                {"error": f"no route {request.method} {request.url.path}"}, 404, close=post
            )
        task = asyncio.ensure_future(respond(request))  # runs to its end if the client leaves
        running.add(task)
        task.add_done_callback(running.discard)
        return await asyncio.shield(task)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown(wait=False)

    app = Starlette(
        routes=[Route("/v1/{path:path}", handle, methods=["GET", "POST"])], lifespan=lifespan
    )
    app.state.budget = budget  # what the requests in flight hold now (tests, monitoring)
    return app
