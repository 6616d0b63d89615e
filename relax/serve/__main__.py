"""``python -m relax.serve``: the training service (``relax.serve.server``; ``--help`` lists the flags)."""

from __future__ import annotations

import logging
import sys

import tyro


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from relax.serve.server import (
        ServeConfig,
        check_binding,
        check_parallel,
        load_service,
        make_app,
        read_token,
    )

    cfg = tyro.cli(ServeConfig, args=sys.argv[1:] if argv is None else argv, description=__doc__)
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
