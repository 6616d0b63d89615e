"""``python -m relax.serve``: the training service (``relax.serve.server``; ``--help`` lists the flags).
``relax serve`` is the same command."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import tyro

if TYPE_CHECKING:
    from relax.serve.server import ServeConfig


def main(argv: list[str] | None = None) -> None:
    from relax.serve.server import ServeConfig

    argv = sys.argv[1:] if argv is None else argv
    serve(tyro.cli(ServeConfig, args=argv, description=__doc__, prog="python -m relax.serve"))


def serve(cfg: ServeConfig) -> None:
    """Load the service ``cfg`` describes and serve it until interrupted: the port bound first,
    then (no token given) a token generated into ``tokens.local_token_file(port)``, removed at
    the end."""
    import socket

    import uvicorn

    from relax.serve.server import (
        allowed_hosts,
        check_binding,
        check_parallel,
        inflight_mb,
        load_service,
        make_app,
        read_token,
    )
    from relax.serve.tokens import local_token_file, remove_token, write_token

    token = read_token(cfg)
    check_binding(cfg, token)
    check_parallel(cfg)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("relax.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    service = load_service(cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.create_server((cfg.host, cfg.port), family=family)
    port = sock.getsockname()[1]
    token_file = None
    if token is None:
        token_file = local_token_file(port)
        token = write_token(token_file)
    hosts, inflight = allowed_hosts(cfg), inflight_mb(cfg)  # the model loaded: what is left
    logger.info(
        "serving %s on http://%s:%d (state in %s)", service.cfg.model, cfg.host, port, service.root
    )
    logger.info(
        "token: %s; Host names served: %s; bodies up to %d MiB, %d MiB in flight in all",
        f"generated into {token_file} (mode 0600, read by clients on this machine)"
        if token_file is not None
        else f"the user's ({cfg.token_file or 'RELAX_SERVE_TOKEN'})",
        "any" if "*" in hosts else ", ".join(hosts),
        cfg.max_body_mb,
        inflight,
    )
    app = make_app(
        service,
        token,
        max_body_mb=cfg.max_body_mb,
        max_inflight_mb=inflight,
        hosts=hosts,
    )
    signal.signal(signal.SIGTERM, _exit)  # uvicorn re-raises it once stopped: exit through finally
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn stopped, then re-raised Ctrl-C's signal: as uvicorn.run
        pass
    finally:
        sock.close()
        if token_file is not None and not remove_token(token_file, token):
            logger.warning("%s holds another server's token now: left in place", token_file)


def _exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
