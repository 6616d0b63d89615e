"""The training service's cost: one GRPO loop three ways, and K clients with their own adapters at
once against the K loops one after another.

Model: the small config (Llama architecture, vocab 4096, hidden 256, 4 layers; random weights,
saved as a Hugging Face directory the server loads), rank-8 adapters, float32. One iteration: 8
prompts of 32 random tokens x 8 completions of 64 new tokens (no stop token: every completion is
full length), reward = the share of a completion's tokens equal to one target token, group-centred
advantages, one importance-sampling update, one Adam step. Seconds per iteration: the median over
iterations after ``--warmup`` (compiles), then the median over ``--runs`` runs; modes alternate.

``overhead`` modes:

- ``http``: the loop as client code against ``python -m relax.serve`` in its own process on this
  machine: ``save_weights_for_sampler``, ``sample_many``, ``forward_backward`` of 64 ``Datum`` s
  (the Tinker layout: each sequence whole, a summed loss), ``optim_step``, msgpack over HTTP;
- ``in_process``: the same client code and requests on the same operations in this process
  (``LocalServiceClient``: no HTTP, no msgpack);
- ``http_rows``: ``http`` with each group sent as prefix-shared ``LossRows`` (``grouped_rows``:
  the prompt read once for its 8 completions, relax's token-mean loss) instead of 64 datums;
- ``primitives``: the loop written in-process with relax's primitives, no service:
  ``relax.train.primitives.sample``, the rollout's own ``LossRows`` (prompts shared by their
  completions) to ``relax.serve.objectives`` ``"importance_sampling"``, ``objective_optim_step``.

``clients``: for each K of ``--clients``, K client loops (sessions with their own adapters) at once
against the server, and the same K loops one after another: wall-clock seconds and iterations
per second.

    python benchmarks/serve.py --out cpu-2026-11-28-serve.jsonl
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import emit  # noqa: E402

from relax.algorithms.online.batch import LossRows  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.models.adapters.operations import add_lora  # noqa: E402
from relax.models.hf.checkpoint import save_pretrained  # noqa: E402
from relax.models.layers.lora import LoRAConfig  # noqa: E402
from relax.rollout.sampler import RolloutConfig  # noqa: E402
from relax.serve import objectives, types  # noqa: E402
from relax.serve.client import LocalServiceClient, ServiceClient, grouped_rows  # noqa: E402
from relax.serve.server import ServeConfig, load_service  # noqa: E402
from relax.serve.session import OPTIMIZER  # noqa: E402
from relax.train import primitives  # noqa: E402
from relax.train.state import init_state  # noqa: E402

P, G, LP, N, TARGET, RANK, LR = 8, 8, 32, 64, 7, 8, 1e-3


def prompts(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(8, 4096, (P, LP)).astype(np.int32)


def client_loop(service, steps: int, seed: int, rows: bool = False) -> list[float]:
    """Seconds of each iteration of the loop as client code (module docstring); ``rows``: the
    groups sent as prefix-shared ``LossRows`` (``grouped_rows``), not datums."""
    trainer = service.create_lora_training_client(rank=RANK, seed=seed)
    rng, seconds = np.random.default_rng(seed), []
    for step in range(steps):
        start = time.perf_counter()
        sampler = trainer.save_weights_and_get_sampling_client(f"it{step}")
        ids = prompts(rng)
        responses = sampler.sample_many(
            [types.ModelInput.from_ints(p) for p in ids], G, types.SamplingParams(max_tokens=N)
        ).result()
        data, advantages = [], []
        for p, response in zip(ids, responses):
            r = np.asarray([np.mean(np.asarray(s.tokens) == TARGET) for s in response.sequences])
            advantages.append(r - r.mean())
            for s, a in zip(response.sequences, r - r.mean()):
                tokens = np.concatenate([p, s.tokens])
                data.append(
                    types.Datum(
                        types.ModelInput.from_ints(tokens[:-1]),
                        {
                            "target_tokens": tokens[1:],
                            "logprobs": np.r_[np.zeros(LP - 1), s.logprobs].astype(np.float32),
                            "advantages": np.r_[np.zeros(LP - 1), np.full(len(s.tokens), a)].astype(
                                np.float32
                            ),
                        },
                    )
                )
        trainer.forward_backward(
            grouped_rows(ids, responses, advantages) if rows else data, "importance_sampling"
        )
        trainer.optim_step(types.AdamParams(learning_rate=LR)).result()
        seconds.append(time.perf_counter() - start)
    trainer.close()
    return seconds


def primitives_loop(base, steps: int, seed: int) -> list[float]:
    """Seconds of each iteration of the same loop with relax's primitives in-process."""
    key = jax.random.key(seed)
    state = init_state(
        add_lora(base, LoRAConfig(rank=RANK), key), OPTIMIZER, key=jax.random.fold_in(key, 1)
    )
    cfg = RolloutConfig(num_generations=G, max_new_tokens=N, prompt_buckets=(LP,))
    fb, step_fn = (
        objectives.make_objective_forward_backward("importance_sampling"),
        jax.jit(objectives.objective_optim_step),
    )
    rng, seconds = np.random.default_rng(seed), []
    for _ in range(steps):
        start = time.perf_counter()
        ids = jnp.asarray(prompts(rng))
        mask = jnp.ones_like(ids)
        rollout = primitives.sample(state, ids, mask, cfg)
        r = np.asarray(jnp.mean(rollout.tokens == TARGET, -1))
        rows = LossRows(
            prompt_ids=ids,
            prompt_mask=mask,
            tokens=rollout.tokens,
            mask=rollout.mask,
            loss_mask=rollout.mask,
            old_logprobs=rollout.logprobs,
            advantages=jnp.asarray(r - r.mean(-1, keepdims=True)),
        )
        grads, _ = fb(state, rows)
        state = jax.block_until_ready(step_fn(state, grads))
        seconds.append(time.perf_counter() - start)
    return seconds


def start_server(model_dir: str, state_dir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relax.serve",
            "--model",
            model_dir,
            "--state-dir",
            state_dir,
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            ServiceClient(url).get_server_capabilities()
            return proc, url
        except Exception as e:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode})") from e
            time.sleep(0.5)
    raise TimeoutError("the server did not start")


def clients_wall(url: str, k: int, steps: int, concurrent: bool) -> float:
    start = time.perf_counter()
    if concurrent:
        threads = [
            threading.Thread(target=client_loop, args=(ServiceClient(url), steps, 100 + i))
            for i in range(k)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(k):
            client_loop(ServiceClient(url), steps, 100 + i)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--client-steps", type=int, default=4)
    ap.add_argument(
        "--out", default=None, help="also append the JSON lines to benchmarks/results/OUT"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relax-serve-bench-"))
    base = init(small_config(), jax.random.key(0))
    save_pretrained(base, work / "model")
    server, url = start_server(str(work / "model"), str(work / "server"))
    records = []
    try:
        local = LocalServiceClient(
            load_service(ServeConfig(model=str(work / "model"), state_dir=str(work / "local")))
        )
        modes = {
            "http": lambda s: client_loop(ServiceClient(url), args.steps, s),
            "in_process": lambda s: client_loop(local, args.steps, s),
            "http_rows": lambda s: client_loop(ServiceClient(url), args.steps, s, rows=True),
            "primitives": lambda s: primitives_loop(base, args.steps, s),
        }
        figures: dict[str, list[float]] = {m: [] for m in modes}
        for run in range(args.runs):
            for mode, loop in modes.items():
                figures[mode].append(statistics.median(loop(run)[args.warmup :]))
        for mode, runs in figures.items():
            records.append(
                emit(
                    {
                        "bench": "serve_overhead",
                        "mode": mode,
                        "sec_per_iter": statistics.median(runs),
                        "runs": runs,
                        "steps": args.steps,
                        "warmup": args.warmup,
                    }
                )
            )
        for k in args.clients:
            walls: dict[str, list[float]] = {"concurrent": [], "sequential": []}
            for _ in range(args.runs):
                for mode in walls:
                    walls[mode].append(
                        clients_wall(url, k, args.client_steps, mode == "concurrent")
                    )
            c, s = statistics.median(walls["concurrent"]), statistics.median(walls["sequential"])
            records.append(
                emit(
                    {
                        "bench": "serve_clients",
                        "k": k,
                        "steps": args.client_steps,
                        "concurrent_s": c,
                        "sequential_s": s,
                        "iters_per_s_concurrent": k * args.client_steps / c,
                        "iters_per_s_sequential": k * args.client_steps / s,
                        "speedup": s / c,
                        "runs_concurrent": walls["concurrent"],
                        "runs_sequential": walls["sequential"],
                    }
                )
            )
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.out:
        with open(ROOT / "benchmarks" / "results" / args.out, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)


if __name__ == "__main__":
    main()
