"""The training service end to end (slow): ``python -m relax.serve`` in its own process on the built-in
task, ``examples/serve_grpo.py``'s client-side GRPO learns it, a second client with its own
adapter training at the same time changes nothing of the first's results, and a session saved
before the server is killed (-9) comes back in a new server process."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from relax.serve.client import ServiceClient
from relax.serve.types import AdamParams, Datum, ModelInput

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def load_example():
    spec = importlib.util.spec_from_file_location("serve_grpo", ROOT / "examples" / "serve_grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_grpo"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def start_server(state_dir: Path, port: int) -> subprocess.Popen:
    log = open(state_dir.parent / f"server-{port}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax.serve", "--state-dir", str(state_dir), "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client, deadline = ServiceClient(f"http://127.0.0.1:{port}"), time.time() + 900
    while time.time() < deadline:
        try:
            client.get_server_capabilities()
            return proc
        except Exception as e:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log.name}") from e
            time.sleep(1)
    proc.kill()
    raise TimeoutError("the server did not start in 900 s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_trainer(url: str, steps: int, out: list) -> None:
    """A second client: its own rank-4 adapter taught to copy the string (cross-entropy)."""
    trainer = ServiceClient(url).create_lora_training_client(rank=4, seed=123)
    tokenizer = trainer.get_tokenizer()
    for i in range(steps):
        data = []
        for s in ("abc", "hgfe", "dcbah", "efg")[: 2 + i % 3]:
            prompt, answer = (
                tokenizer.encode(s + "="),
                tokenizer.encode(s, add_special_tokens=False),
            )
            tokens = prompt + answer
            data.append(
                Datum(
                    ModelInput.from_ints(tokens[:-1]),
                    {
                        "target_tokens": np.asarray(tokens[1:]),
                        "weights": (np.arange(len(tokens) - 1) >= len(prompt) - 1).astype(
                            np.float32
                        ),
                    },
                )
            )
        out.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss"])
        trainer.optim_step(AdamParams(learning_rate=1e-2)).result()


def test_client_grpo_learns_beside_another_client_and_survives_kill(tmp_path):
    example = load_example()
    state, port = tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(state, port)
    try:
        cfg = example.LoopConfig(url=url, steps=20, eval_every=10)
        alone = example.main(cfg)
        held = [r["held_out_exact_match"] for r in alone if "held_out_exact_match" in r]
        assert held[0] < 0.2 and held[-1] > 0.6, (
            held
        )  # the base model copies; GRPO teaches it to reverse

        copy_losses: list[float] = []
        other = threading.Thread(target=copy_trainer, args=(url, 30, copy_losses))
        other.start()
        beside = example.main(cfg)
        other.join()
        strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
        assert strip(beside) == strip(
            alone
        )  # bit for bit: a session depends on its own requests only
        assert np.mean(copy_losses[-3:]) < 0.5 * np.mean(copy_losses[:3]), copy_losses

        trainer = ServiceClient(url).create_lora_training_client(rank=8, seed=7)
        tokenizer = trainer.get_tokenizer()
        tokens = tokenizer.encode("abcd=") + tokenizer.encode("dcba", add_special_tokens=False)
        datum = Datum(
            ModelInput.from_ints(tokens[:-1]),
            {
                "target_tokens": np.asarray(tokens[1:]),
                "weights": np.ones(len(tokens) - 1, np.float32),
            },
        )
        for _ in range(2):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
        path = trainer.save_state("before-kill").result().path
        loss = trainer.forward([datum], "cross_entropy").result().metrics["loss"]
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
    server = start_server(state, port)
    try:
        restored = ServiceClient(url).create_training_client_from_state(path)
        assert restored.forward([datum], "cross_entropy").result().metrics["loss"] == loss
    finally:
        server.terminate()
        server.wait(timeout=60)
