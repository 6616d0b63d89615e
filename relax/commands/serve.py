"""The training service from the command line (``relax serve``): every objective by name over HTTP.

    relax serve --model HF_DIR --lora.rank 16             # 127.0.0.1:8470
    relax serve                                           # the built-in task's base model
    relax serve --model HF_DIR --host 0.0.0.0 --allow-remote --token-file TOKEN

``python -m relax.serve`` is the same command, with the same flags; it needs the service's packages
(``pip install -e '.[serve]'`` in the checkout).

Clients: ``relax.serve.ServiceClient`` (Tinker-style calls that
return futures; ``examples/serve_grpo.py`` trains GRPO through it). The routes, the order requests
run in, the errors and the security rules: ``relax.serve.server``. Every field of
``relax.serve.server.ServeConfig`` is a flag; ``--help`` lists them.
"""

from __future__ import annotations

from relax.commands.command import Command

NAME = "serve"


def run(argv: list[str]) -> int:
    """Flags -> the service, served until interrupted; exit status 0."""
    import tyro

    try:
        from relax.serve.__main__ import serve
        from relax.serve.server import ServeConfig
    except ModuleNotFoundError as e:
        raise SystemExit(
            f"relax serve needs {e.name}: pip install -e '.[serve]' in the relax checkout"
        ) from e
    serve(tyro.cli(ServeConfig, args=argv, description=__doc__, prog=f"relax {NAME}"))
    return 0


COMMAND = Command(NAME, "the training service: every objective by name over HTTP", run)
