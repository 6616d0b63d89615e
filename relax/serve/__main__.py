"""``python -m relax.serve``: the training service (``relax.serve.server``; ``--help`` lists the flags).
``relax serve`` is the same command."""

from __future__ import annotations

import logging
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
    """Load the service ``cfg`` describes and serve it until interrupted."""
    import uvicorn

    from relax.serve.server import check_binding, check_parallel, load_service, make_app, read_token

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
    logger.info(
        "serving %s on http://%s:%d (state in %s)",
        service.cfg.model,
        cfg.host,
        cfg.port,
        service.root,
    )
    uvicorn.run(
        make_app(service, token, max_body_mb=cfg.max_body_mb),
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
