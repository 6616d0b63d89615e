"""The service's tokens: the user's checked, a local server's generated and kept where only its user
can read it, and found there by a client on the same machine (as Jupyter does).

    token = check_token(Path("TOKEN").read_text().strip(), "TOKEN")   # ValueError: blank, short
    path = local_token_file(8470)                                     # ~/.relax/serve-8470.token
    token = write_token(path)                                         # mode 0600 from the start
    remove_token(path, token)                                         # at shutdown, if still ours

A generated token is ``secrets.token_urlsafe(32)`` (256 random bits). Its file is created under a
temporary name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, so it is never readable by
anyone else, not even for a moment, then renamed over ``local_token_file(port)`` (a stale file of
a killed server is replaced). This module imports nothing heavy: the client uses it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = [
    "LOCAL_HOSTS",
    "MIN_TOKEN_LENGTH",
    "check_token",
    "local_token_file",
    "read_local_token",
    "remove_token",
    "write_token",
]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_LENGTH = 16


def check_token(token: str, source: str) -> str:
    """``token`` if it can guard a server: at least ``MIN_TOKEN_LENGTH`` printable ASCII characters,
    no whitespace (it travels in an ``Authorization`` header); a ``ValueError`` naming ``source``
    (the file or variable it came from) otherwise."""
    if not token.strip():
        raise ValueError(f"{source}: the token is blank")
    bad = [c for c in token if not ("!" <= c <= "~")]
    if bad:
        raise ValueError(
            f"{source}: the token holds {bad[0]!r}; a token is printable ASCII without whitespace"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"{source}: a token of {len(token)} characters is guessable; use at least "
            f"{MIN_TOKEN_LENGTH} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def local_token_file(port: int) -> Path:
    """Where a local server on ``port`` keeps its generated token: ``~/.relax/serve-<port>.token``."""
    return Path.home() / ".relax" / f"serve-{port}.token"


def write_token(path: Path) -> str:
    """A new token, written to ``path`` (mode 0600 from its creation; module docstring)."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def read_local_token(port: int) -> str | None:
    """The token a local server on ``port`` generated (None: no such file, or not readable)."""
    try:
        return local_token_file(port).read_text().strip() or None
    except OSError:
        return None


def remove_token(path: Path, token: str) -> bool:
    """Remove ``path`` if it still holds ``token``. False: it holds another (a newer server's,
    left alone); an ``OSError`` other than a missing file is raised."""
    try:
        if path.read_text().strip() != token:
            return False
        path.unlink()
    except FileNotFoundError:
        pass
    return True
