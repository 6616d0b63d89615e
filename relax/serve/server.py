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

Errors: a refused request is ``400 {"error", "field"}`` naming the field, an unknown session
``404``, a missing or wrong token ``401``, anything else ``500 {"error"}`` (logged with its
traceback); none of them changes a session (``relax.serve.session``).

Security: the server binds to 127.0.0.1 unless ``--allow-remote`` is given, which also needs a
token (``--token-file`` or ``RELAX_SERVE_TOKEN``); with a token every request must carry
``Authorization: Bearer <token>``. Bodies are msgpack, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from relax.models.lora import LoRAConfig
from relax.serve.service import Service, ServiceConfig, UnknownSession
from relax.serve.wire import RequestError, pack, unpack

__all__ = ["MEDIA_TYPE", "ServeConfig", "check_binding", "load_service", "make_app", "read_token"]

MEDIA_TYPE = "application/msgpack"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SESSION_OPS = ("forward_backward", "forward", "optim_step", "save_state", "load_state", "save_weights",
               "save_weights_for_sampler", "close")
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
    host: str = "127.0.0.1"
    port: int = 8470
    allow_remote: bool = False
    """Bind to a host other than localhost (needs a token)."""
    token_file: str | None = None
    """A file holding the token clients must send (else ``RELAX_SERVE_TOKEN``; none: no token)."""
    state_dir: str = "runs/serve"
    """Where ``save_state`` and ``save_weights`` write (and ``load_state`` reads)."""


def read_token(cfg: ServeConfig) -> str | None:
    if cfg.token_file is not None:
        token = Path(cfg.token_file).read_text().strip()
        if not token:
            raise ValueError(f"{cfg.token_file}: the token file is empty")
        return token
    return os.environ.get("RELAX_SERVE_TOKEN") or None


def check_binding(cfg: ServeConfig, token: str | None) -> None:
    """Only localhost without ``--allow-remote``; a remote binding only with a token."""
    if cfg.host not in LOCAL_HOSTS and not cfg.allow_remote:
        raise ValueError(f"--host {cfg.host} serves beyond this machine: pass --allow-remote (and a token) "
                         f"to do that on purpose; the default is 127.0.0.1")
    if cfg.allow_remote and token is None:
        raise ValueError("--allow-remote needs a token: --token-file FILE or RELAX_SERVE_TOKEN")


def load_service(cfg: ServeConfig) -> Service:
    """The model (``cfg.model`` or the built-in task's) and its tokenizer, served."""
    import jax.numpy as jnp

    from relax.models.hf import load_pretrained
    from relax.text import load_tokenizer

    dtype = jnp.dtype(cfg.dtype)
    if cfg.model is None:
        from relax.tasks import TASKS
        from relax.tasks.base import prepare
        from relax.tasks.reverse import ReverseTask

        tokenizer, base, _, _ = prepare(TASKS["reverse"], ReverseTask(), Path(cfg.state_dir) / "builtin", seed=0,
                                        teacher="a noisy teacher of the reverse task", log=log.info)
        name = str(Path(cfg.state_dir, "builtin", "base_model").resolve())
        base = load_pretrained(name, dtype=dtype)
    else:
        name = cfg.model
        base, tokenizer = load_pretrained(cfg.model, dtype=dtype), load_tokenizer(cfg.model)
    return Service(base, tokenizer, ServiceConfig(model=name, state_dir=cfg.state_dir, lora=cfg.lora))


def _reply(obj, status: int = 200) -> Response:
    return Response(pack(obj), status_code=status, media_type=MEDIA_TYPE)


def make_app(service: Service, token: str | None = None) -> Starlette:
    """The app: every operation runs on one worker thread, in arrival order (module docstring)."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-serve")

    def handler(op, *, session: bool, body: bool = True):
        async def handle(request: Request) -> Response:
            if token is not None:
                sent = request.headers.get("authorization", "")
                if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                    return _reply({"error": "a valid 'Authorization: Bearer <token>' header is needed"}, 401)
            try:
                payload = unpack(await request.body()) if body else {}
                if not isinstance(payload, dict):
                    raise RequestError("body", "the body must be a map")
                args = (request.path_params["sid"], payload) if session else ((payload,) if body else ())
                future = worker.submit(functools.partial(op, *args))
                return _reply(await asyncio.shield(asyncio.wrap_future(future)))
            except RequestError as e:
                return _reply({"error": str(e), "field": e.field}, 400)
            except UnknownSession as e:
                return _reply({"error": f"no session {e.args[0]!r} (closed, or from before a restart: "
                                        "create_training_client_from_state)", "field": "session"}, 404)
            except Exception as e:
                log.exception("request %s failed", request.url.path)
                return _reply({"error": f"{type(e).__name__}: {e}"}, 500)
        return handle

    ops = {"forward_backward": service.forward_backward,
           "forward": functools.partial(service.forward_backward, backward=False),
           "optim_step": service.optim_step, "save_state": service.save_state, "load_state": service.load_state,
           "save_weights": service.save_weights, "save_weights_for_sampler": service.save_weights_for_sampler,
           "close": lambda sid, _: service.close_session(sid)}
    routes = [Route("/v1/info", handler(service.info, session=False, body=False), methods=["GET"]),
              Route("/v1/tokenizer", handler(service.tokenizer_files, session=False, body=False), methods=["GET"]),
              Route("/v1/sessions", handler(service.create_session, session=False), methods=["POST"]),
              Route("/v1/sessions/from_state", handler(service.create_session_from_state, session=False),
                    methods=["POST"]),
              Route("/v1/sample", handler(service.sample, session=False), methods=["POST"])]
    routes += [Route(f"/v1/sessions/{{sid}}/{name}", handler(ops[name], session=True), methods=["POST"])
               for name in SESSION_OPS]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown(wait=False)

    return Starlette(routes=routes, lifespan=lifespan)
