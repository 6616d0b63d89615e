"""The service's HTTP layer against a hostile client (relax.serve.server, guard, tokens): a web
page's cross-site POST and DNS rebinding refused with nothing created or written, the token
required and kept private (generated, 0600, found by the client), blank or short tokens refused
at start-up, bodies refused as soon as they pass the body limit or the in-flight budget (four
concurrent bodies: the server stays up and answers). The decoder and the fuzz:
``test_serve_decoder``."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient
from test_serve import BASE, CFG, service  # the tiny model and its service

from relax.serve.client import ServiceClient, ServiceError
from relax.serve.server import ServeConfig, make_app, read_token
from relax.serve.tokens import local_token_file, remove_token, write_token
from relax.serve.wire import (
    from_msgpack,
    to_msgpack,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-0123456789abcdef"
MSGPACK = {"content-type": "application/msgpack", "authorization": f"Bearer {TOKEN}"}
MiB = 1 << 20


def local_client(app) -> TestClient:
    """The app as a local client sees it: its own host name, the token, msgpack bodies."""
    return TestClient(app, base_url="http://127.0.0.1:8470", headers=MSGPACK)


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app, port: int):
    """``app`` on uvicorn on 127.0.0.1:``port`` in a thread, stopped at the end."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ------------------------------------------------------------------------- same-origin


def test_cross_site_post_creates_nothing_and_writes_nothing(tmp_path):
    """The red team's request: a web page's ``text/plain`` POST with ``Origin: http://evil.example``
    made a session and had ``save_weights`` write to the server's disk. Refused now by each check
    alone (with the right token, so that only that check stands), and, without any token at all,
    by the content type and the origin: a browser cannot drive the server."""
    for token in (TOKEN, None):
        svc = service(tmp_path / str(token))
        client = local_client(make_app(svc, token=token))
        made = client.post("/v1/sessions", content=to_msgpack({"rank": 4}))
        sid = from_msgpack(made.content)["session"]
        before = files_under(tmp_path)
        save = to_msgpack({"name": "pwned"})
        attacks = {  # headers over the local client's, the status each must get
            "the red team's": (
                {
                    "content-type": "text/plain",
                    "origin": "http://evil.example",
                    "authorization": "",
                },
                403,
            ),
            "text/plain": ({"content-type": "text/plain"}, 415),
            "no content type": ({"content-type": ""}, 415),
            "form": ({"content-type": "application/x-www-form-urlencoded"}, 415),
            "origin": ({"origin": "http://evil.example"}, 403),
            "null origin": ({"origin": "null"}, 403),
            "other local port": ({"origin": "http://127.0.0.1:3000"}, 403),
            "fetch metadata": ({"sec-fetch-site": "cross-site"}, 403),
            "rebinding": ({"host": "evil.example:8470"}, 403),
        }
        if token is not None:
            attacks["no token"] = ({"authorization": ""}, 401)
            attacks["wrong token"] = ({"authorization": f"Bearer {TOKEN[:-1]}x"}, 401)
        for name, (headers, status) in attacks.items():
            for path, body in (
                ("/v1/sessions", to_msgpack({"rank": 4})),
                (f"/v1/sessions/{sid}/save_weights", save),
            ):
                response = client.post(path, content=body, headers=headers)
                assert response.status_code == status, (token, name, path, response.content)
                assert "error" in from_msgpack(response.content)
        assert list(svc.sessions) == [sid] and files_under(tmp_path) == before
        preflight = client.options(
            "/v1/sessions",
            headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
        )  # a page asking to send application/msgpack: no CORS answer, so the browser never sends
        assert (
            preflight.status_code >= 400 and "access-control-allow-origin" not in preflight.headers
        )
        # the server's own names and origin pass
        for host in ("127.0.0.1:8470", "localhost:8470", "[::1]:8470", "LOCALHOST"):
            headers = {"host": host, "origin": f"http://{host}"}
            assert client.get("/v1/info", headers=headers).status_code == 200, host


def test_allowed_hosts_of_a_remote_server(tmp_path):
    app = make_app(service(tmp_path), token=TOKEN, hosts=("127.0.0.1", "gpu-box.lan"))
    client = local_client(app)
    assert client.get("/v1/info", headers={"host": "gpu-box.lan:8470"}).status_code == 200
    refused = client.get("/v1/info", headers={"host": "gpu-box.lan.evil.example"})
    assert (
        refused.status_code == 403 and "--allowed-hosts" in from_msgpack(refused.content)["error"]
    )
    anyone = local_client(make_app(service(tmp_path), token=TOKEN, hosts=("*",)))
    assert anyone.get("/v1/info", headers={"host": "10.1.2.3:8470"}).status_code == 200


# ------------------------------------------------------------------------------ tokens


def test_user_tokens_blank_or_short_refused_at_startup(tmp_path, monkeypatch):
    from relax.serve.__main__ import main

    monkeypatch.delenv("RELAX_SERVE_TOKEN", raising=False)
    for text, why in (
        ("", "blank"),
        ("  \n\t", "blank"),
        ("x", "1 characters"),
        ("short-token", "11 characters"),
        ("a token with spaces in it", "holds ' '"),
        ("tab\there-0123456789", "holds '\\t'"),
    ):
        path = tmp_path / "token"
        path.write_text(text + "\n")
        why = re.escape(why)
        with pytest.raises(ValueError, match=why):
            read_token(ServeConfig(token_file=str(path)))
        with pytest.raises(ValueError, match=why):  # before anything is loaded or bound
            main(["--token-file", str(path), "--model", str(tmp_path / "never-read")])
        monkeypatch.setenv("RELAX_SERVE_TOKEN", text)
        with pytest.raises(ValueError, match=f"RELAX_SERVE_TOKEN: .*{why}"):
            read_token(ServeConfig())
        monkeypatch.delenv("RELAX_SERVE_TOKEN")
    path.write_text(TOKEN + "\n")
    assert read_token(ServeConfig(token_file=str(path))) == TOKEN
    assert read_token(ServeConfig()) is None  # none given: a local server generates one


def test_generated_token_file_is_private_from_its_creation(tmp_path, monkeypatch):
    """The token file is 0600 whatever the umask, and a file or link planted at its path by
    someone else is replaced, never written through (a plain ``open(path, "w")`` would keep a
    planted world-readable file's mode, and follow a planted link)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = local_token_file(8470)
    assert path == tmp_path / ".relax" / "serve-8470.token"
    old = os.umask(0)
    try:
        token = write_token(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == f"{token}\n"
    assert len(token) >= 43 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    planted = tmp_path / "readable-by-all"
    planted.write_text("the attacker's")
    planted.chmod(0o644)
    path.unlink()
    path.symlink_to(planted)
    token = write_token(path)
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert planted.read_text() == "the attacker's"
    path.unlink()
    path.write_text("stale")
    path.chmod(0o644)
    token = write_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == token
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert not remove_token(path, "another server's") and path.exists()
    assert remove_token(path, token) and not path.exists()


def test_client_finds_the_local_token_by_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RELAX_SERVE_TOKEN", raising=False)
    port = free_port()
    path = local_token_file(port)
    token = write_token(path)
    path.rename(tmp_path / "aside")
    client = ServiceClient(f"http://127.0.0.1:{port}")  # made before the file exists
    svc = service(tmp_path / "state")
    with running(make_app(svc, token=token), port):
        with pytest.raises(ServiceError, match=f"no token given: read {path}") as e:
            client.get_server_capabilities()
        assert e.value.status == 401
        (tmp_path / "aside").rename(path)  # written: read at the next request
        assert client.get_server_capabilities()["vocab_size"] == CFG.vocab_size
        trainer = client.create_lora_training_client(rank=2)
        assert list(svc.sessions) == [trainer.session]
        with pytest.raises(ServiceError) as e:
            ServiceClient(f"http://localhost:{port}", token="not-the-token-at-all").call(
                "GET", "/v1/info"
            )
        assert e.value.status == 401


# ------------------------------------------------------------------------------- bodies


def post_raw(
    port: int, length: int, body: bytes = b"", path: str = "/v1/sessions"
) -> socket.socket:
    """A POST that declares ``length`` bytes and sends ``body`` of them (the rest: later, or never)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/msgpack\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict, dict]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    out = from_msgpack(response.read())
    sock.close()
    return response.status, dict(response.getheaders()), out


def body_of(n: int) -> bytes:
    for pad in range(n - 20, n):
        body = to_msgpack({"rank": 2, "pad": b"\0" * pad})
        if len(body) == n:
            return body
    raise AssertionError(n)


def wait_for(predicate, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server with a 4 MiB body limit and 8 MiB in flight in all."""
    svc = service(tmp_path_factory.mktemp("bodies"))
    app = make_app(svc, token=TOKEN, max_body_mb=4, max_inflight_mb=8)
    port = free_port()
    with running(app, port) as url:
        yield port, url, app.state.budget, svc


def test_body_over_the_limit_refused_before_it_is_sent(small_server):
    port, url, budget, _ = small_server
    status, _, out = answer(post_raw(port, 10 << 30))  # 10 GiB declared, nothing sent
    assert status == 413 and "--max-body-mb" in out["error"]

    sent = []

    def endless():
        while True:
            sent.append(64 << 10)
            yield b"\0" * (64 << 10)

    with httpx.Client(headers=MSGPACK, timeout=10) as client:  # chunked: no Content-Length
        response = client.post(f"{url}/v1/sessions", content=endless())
    assert response.status_code == 413 and response.headers["connection"] == "close"
    assert sum(sent) < 64 * MiB  # refused as it passed 4 MiB, not read to the end
    wait_for(lambda: budget.held == 0)
    assert httpx.get(f"{url}/v1/info", headers=MSGPACK).status_code == 200


def test_inflight_budget_refuses_concurrent_bodies(small_server):
    """Four concurrent bodies each under the body limit (the red team's four 400 MiB under 1 GiB,
    scaled down): the one that does not fit beside the others is refused at once, before its body
    is sent; none of them can take the server over its budget; it stays up and answers."""
    port, url, budget, svc = small_server
    n = 2 * MiB + MiB // 2  # 2.5 MiB: three fit in 8 MiB while received, one decoded needs 7.5
    body = body_of(n)
    socks = []
    for i in range(3):
        socks.append(post_raw(port, n, body[: n // 2]))
        wait_for(lambda: budget.held >= (i + 1) * n)
    status, headers, out = answer(post_raw(port, n))
    assert status == 429 and "--max-inflight-mb" in out["error"] and headers["retry-after"]
    assert budget.held == 3 * n <= budget.limit
    results = []

    def finish(sock):
        sock.sendall(body[n // 2 :])
        results.append(answer(sock))

    threads = [threading.Thread(target=finish, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # each needs 7.5 MiB to decode: only the last, once the others were refused and let go
    assert sorted(r[0] for r in results) == [400, 429, 429], results
    for status, _, out in results:  # decoded and run (the service names 'pad'), or refused
        assert out["field"] == ("pad" if status == 400 else "body"), out
    wait_for(lambda: budget.held == 0)
    status, _, out = answer(post_raw(port, n, body))  # alone, it fits
    assert (status, out["field"]) == (400, "pad")
    status, _, out = answer(post_raw(port, 3 * MiB, body_of(3 * MiB)))  # 9 MiB to decode: never
    assert status == 413 and "--max-inflight-mb" in out["error"]
    assert httpx.get(f"{url}/v1/info", headers=MSGPACK).status_code == 200
    assert not svc.sessions and budget.held == 0


# ------------------------------------------------------------------------ the command


@pytest.mark.slow
def test_python_m_relax_serve_generates_the_token_and_the_client_needs_nothing(
    tmp_path, monkeypatch
):
    """``python -m relax.serve`` with no token: it writes one (0600) where the client finds it,
    refuses requests without it, and removes the file when it stops."""
    from relax.models.hf.checkpoint import save_pretrained

    save_pretrained(BASE, tmp_path / "model")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RELAX_SERVE_TOKEN", raising=False)
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relax.serve",
            "--model",
            str(tmp_path / "model"),
            "--port",
            str(port),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        path = local_token_file(port)
        wait_for(lambda: path.exists() or proc.poll() is not None, 120)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        client = ServiceClient(f"http://127.0.0.1:{port}", timeout=30)
        deadline = time.time() + 60
        while True:
            try:
                info = client.get_server_capabilities()
                break
            except httpx.TransportError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert info["vocab_size"] == CFG.vocab_size
        assert client.create_lora_training_client(rank=2).session
        assert httpx.get(f"http://127.0.0.1:{port}/v1/info").status_code == 401
        assert str(path) in (tmp_path / "server.log").read_text()
    finally:
        proc.terminate()  # SIGTERM, as a process manager stops it
        proc.wait(timeout=60)
    assert not path.exists()
