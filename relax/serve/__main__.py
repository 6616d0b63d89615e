"""``python -m relax.serve``: the training service (``relax.serve.server``; ``--help`` lists the flags)."""

from __future__ import annotations

import logging
import sys

import tyro


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from relax.serve.server import ServeConfig, check_binding, load_service, make_app, read_token

    cfg = tyro.cli(ServeConfig, args=sys.argv[1:] if argv is None else argv, description=__doc__)
    token = read_token(cfg)
    check_binding(cfg, token)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    service = load_service(cfg)
    logging.getLogger("relax.serve").info("serving %s on http://%s:%d (state in %s)", service.cfg.model, cfg.host,
                                          cfg.port, service.root)
    uvicorn.run(make_app(service, token), host=cfg.host, port=cfg.port, log_level="warning")


if __name__ == "__main__":
    main()
