"""The training service's Python client, named after Tinker's (``tinker.ServiceClient``).

    from relax.serve.client import ServiceClient
    from relax.serve.types import AdamParams, Datum, ModelInput, SamplingParams

    service = ServiceClient("http://127.0.0.1:8470")
    trainer = service.create_lora_training_client(rank=8)
    sampler = trainer.save_weights_and_get_sampling_client("it0")
    response = sampler.sample(ModelInput.from_ints(prompt), 8, SamplingParams(max_tokens=16)).result()
    fb = trainer.forward_backward(datums, "importance_sampling")        # a Future
    step = trainer.optim_step(AdamParams(learning_rate=1e-4))           # sent after it, runs after it
    fb.result().metrics, step.result().metrics

Every call returns a ``concurrent.futures.Future`` at once. A ``TrainingClient`` sends its
requests one at a time, in the order they were made (one sender thread), so they run in that
order on the server; a ``SamplingClient`` sends up to ``parallel`` at once. ``forward_backward``
takes Tinker's ``Datum`` list with a datum loss (``relax.serve.datum``), or one of relax's typed
batches with a named objective (``relax.serve.objectives``; ``loss_fn_config`` its kwargs).

Where it differs from Tinker: futures are ``concurrent.futures.Future`` (no ``*_async``
coroutines); a ``ModelInput`` is token ids only (no image chunks); ``get_tokenizer`` returns
relax's tokenizer (``relax.text``); ``save_state`` / ``save_weights`` paths are the server's
directories, not ``tinker://`` URIs (``SaveResponse.path``); relax adds ``save_weights`` (PEFT or Hugging Face format)
and typed batches; ``compute_logprobs`` and ``forward`` on datums are ``forward``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from relax.algorithms.online.batch import LossRows
from relax.serve.datum import bucket
from relax.serve.tokens import LOCAL_HOSTS, local_token_file, read_local_token
from relax.serve.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveResponse,
    TensorData,
)
from relax.serve.wire import RequestError, encode_batch, from_msgpack, materialize, to_msgpack

__all__ = [
    "LocalServiceClient",
    "grouped_rows",
    "ServiceClient",
    "ServiceError",
    "SamplingClient",
    "TrainingClient",
]

MEDIA_TYPE = "application/msgpack"


class ServiceError(RuntimeError):
    """The server refused or failed a request: ``status`` (400, 401, 403, 404, 413, 415, 429,
    500), ``field`` (what was wrong in the request, when it says)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.field = status, field


class ServiceClient:
    """A connection to ``python -m relax.serve``. Its token: ``token`` (or ``api_key``, Tinker's
    name), else ``RELAX_SERVE_TOKEN``, else, for a server on this machine, the one it generated
    (``tokens.local_token_file(port)``, read before each request: a restarted server's new one
    is found too)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8470",
        *,
        token: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ):
        token = token or api_key or os.environ.get("RELAX_SERVE_TOKEN")
        url = httpx.URL(base_url)
        self._local_port = (url.port or 80) if token is None and url.host in LOCAL_HOSTS else None
        headers = {
            "content-type": MEDIA_TYPE,
            **({"authorization": f"Bearer {token}"} if token else {}),
        }
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def _auth(self) -> dict:
        """The generated token's header, for a local server without a given token."""
        if self._local_port is None:
            return {}
        token = read_local_token(self._local_port)
        return {"authorization": f"Bearer {token}"} if token else {}

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self._http.request(
            method, path, content=None if body is None else to_msgpack(body), headers=self._auth()
        )
        if response.status_code == 200:
            return from_msgpack(response.content)
        try:  # the service's own errors are msgpack maps; a proxy's or Starlette's are not
            out = from_msgpack(response.content)
        except RequestError:
            out = {}
        out = out if isinstance(out, dict) else {}
        message = out.get("error", response.text)
        if response.status_code == 401 and self._local_port is not None:
            message += (
                f" (no token given: read {local_token_file(self._local_port)}, written by a "
                "server on this machine; else pass token= or set RELAX_SERVE_TOKEN)"
            )
        raise ServiceError(response.status_code, message, out.get("field"))

    def get_server_capabilities(self) -> dict:
        return self.call("GET", "/v1/info")

    def create_lora_training_client(
        self,
        base_model: str | None = None,
        rank: int | None = None,
        *,
        seed: int = 0,
        value_head: bool = False,
        **lora,
    ) -> TrainingClient:
        """A new session with its own adapters (``rank``, LoRA options; default: the server's);
        ``value_head``: with a value head on the policy's backbone, for the objective ``"ppo"`` on
        ``ValueRows`` (relax's addition). ``base_model``, when given, must be the model the server holds."""
        if base_model is not None and base_model != (
            served := self.get_server_capabilities()["model"]
        ):
            raise ValueError(f"the server holds {served!r}, not {base_model!r}")
        body = {
            "seed": seed,
            "value_head": value_head,
            **lora,
            **({"rank": rank} if rank is not None else {}),
        }
        return TrainingClient(self, self.call("POST", "/v1/sessions", body)["session"])

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        """A new session restored from a ``save_state`` path (also after the server restarted)."""
        return TrainingClient(
            self, self.call("POST", "/v1/sessions/from_state", {"path": path})["session"]
        )

    def create_sampling_client(
        self, model_path: str = "base", *, parallel: int = 4
    ) -> SamplingClient:
        return SamplingClient(self, model_path, parallel=parallel)

    def get_tokenizer(self):
        """The served model's tokenizer (``relax.text``), from the server's files."""
        from relax.text import load_tokenizer

        files = self.call("GET", "/v1/tokenizer")["files"]
        directory = Path(tempfile.mkdtemp(prefix="relax-serve-tokenizer-"))
        for name, data in files.items():
            (directory / Path(name).name).write_bytes(data)
        return load_tokenizer(directory)

    def close(self) -> None:
        self._http.close()


class LocalServiceClient(ServiceClient):
    """The same client on a ``relax.serve.service.Service`` in this process: the same operations
    on one worker thread, without HTTP or msgpack (tests, and the service's overhead measured
    against it: ``benchmarks/serve.py``)."""

    def __init__(self, service):
        self._service = service
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-local")

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        from relax.serve.server import resolve, run

        status, out = self._worker.submit(
            run, resolve(self._service, method, path, materialize(body or {}))
        ).result()
        if status != 200:
            raise ServiceError(status, out["error"], out.get("field"))
        return out

    def close(self) -> None:
        self._worker.shutdown()


def _arrays(tree) -> Any:
    return {k: TensorData(v) if isinstance(v, np.ndarray) else v for k, v in tree.items()}


class TrainingClient:
    """One session: its requests run in the order they were made (module docstring)."""

    def __init__(self, service: ServiceClient, session: str):
        self.service, self.session = service, session
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relax-{session}")

    def _submit(self, op: str, body: dict, parse=lambda out: out) -> Future:
        return self._sender.submit(
            lambda: parse(self.service.call("POST", f"/v1/sessions/{self.session}/{op}", body))
        )

    def _loss_body(self, data, loss_fn: str, loss_fn_config: dict | None) -> dict:
        body: dict[str, Any] = {"loss_fn": loss_fn, "loss_fn_config": loss_fn_config or {}}
        if isinstance(data, (list, tuple)):
            body["data"] = [d.to_wire() if isinstance(d, Datum) else d for d in data]
        else:
            body["batch"] = encode_batch(data)
        return body

    def forward_backward(self, data, loss_fn: str, loss_fn_config: dict | None = None) -> Future:
        """Future of ``ForwardBackwardOutput``; the gradients are summed into the session's until
        ``optim_step``."""
        parse = lambda out: ForwardBackwardOutput(
            [_arrays(o) for o in out["loss_fn_outputs"]], out["metrics"]
        )  # noqa: E731
        return self._submit(
            "forward_backward", self._loss_body(data, loss_fn, loss_fn_config), parse
        )

    def forward(self, data, loss_fn: str, loss_fn_config: dict | None = None) -> Future:
        """``forward_backward`` without gradients: the loss, its metrics and the log-probs."""
        parse = lambda out: ForwardBackwardOutput(
            [_arrays(o) for o in out["loss_fn_outputs"]], out["metrics"]
        )  # noqa: E731
        return self._submit("forward", self._loss_body(data, loss_fn, loss_fn_config), parse)

    def optim_step(self, adam_params: AdamParams = AdamParams()) -> Future:
        return self._submit(
            "optim_step",
            {"adam_params": dataclasses.asdict(adam_params)},
            lambda out: OptimStepResponse(out["metrics"]),
        )

    def save_state(self, name: str) -> Future:
        """Future of a ``SaveResponse``: the server path of the saved adapters, optimizer state, step."""
        return self._submit("save_state", {"name": name}, lambda out: SaveResponse(out["path"]))

    def load_state(self, path: str) -> Future:
        """Future of ``{"step": ...}``: the session's adapters, optimizer state and step from ``path``."""
        return self._submit("load_state", {"path": path})

    def save_weights(self, name: str, format: str = "peft") -> Future:
        """Future of a ``SaveResponse``: the server path of the adapters in PEFT's format
        (``"hf"``: the merged model, with the tokenizer)."""
        return self._submit(
            "save_weights", {"name": name, "format": format}, lambda out: SaveResponse(out["path"])
        )

    def save_weights_for_sampler(self, name: str) -> Future:
        """Future of a ``SaveResponse`` whose ``path`` samples with the weights as they are once it runs."""
        return self._submit(
            "save_weights_for_sampler", {"name": name}, lambda out: SaveResponse(out["path"])
        )

    def save_weights_and_get_sampling_client(
        self, name: str, *, parallel: int = 4
    ) -> SamplingClient:
        return SamplingClient(
            self.service, self.save_weights_for_sampler(name).result().path, parallel=parallel
        )

    def get_tokenizer(self):
        return self.service.get_tokenizer()

    def close(self) -> None:
        """End the session on the server (after every request made so far)."""
        self._submit("close", {}).result()
        self._sender.shutdown()


def grouped_rows(prompts, responses: list[SampleResponse], advantages) -> LossRows:
    """The ``LossRows`` of sampled groups (relax's addition): prompt ``i`` (token ids or a
    ``ModelInput``) with the sequences of ``responses[i]``, their sampler log-probs and
    ``advantages[i][g]``. ``forward_backward(rows, "importance_sampling")`` (or any policy
    objective) then reads each prompt once for all its completions (the prefix-shared forward),
    where datums repeat it per completion; its loss is relax's (the objective's normaliser: by
    default the mean over completion tokens), not a sum. Sizes are rounded up like datums' so that
    nearby ones share a compiled program."""
    prompts = [
        list(p.tokens) if isinstance(p, ModelInput) else [int(t) for t in p] for p in prompts
    ]
    g = len(responses[0].sequences)
    if len(responses) != len(prompts) or any(len(r.sequences) != g for r in responses):
        raise ValueError(
            "one response per prompt, each with the same number of sequences, is needed"
        )
    lp = bucket(max(map(len, prompts)), 16, steps_per_octave=4)
    n = bucket(max(len(s.tokens) for r in responses for s in r.sequences), 16, steps_per_octave=4)
    ids, pmask = np.zeros((len(prompts), lp), np.int32), np.zeros((len(prompts), lp), np.int32)
    tokens, mask = (
        np.zeros((len(prompts), g, n), np.int32),
        np.zeros((len(prompts), g, n), np.int32),
    )
    logprobs = np.zeros((len(prompts), g, n), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, lp - len(p) :], pmask[i, lp - len(p) :] = p, 1
        for j, seq in enumerate(r.sequences):
            k = len(seq.tokens)
            tokens[i, j, :k], mask[i, j, :k], logprobs[i, j, :k] = seq.tokens, 1, seq.logprobs
    return LossRows(
        prompt_ids=ids,
        prompt_mask=pmask,
        tokens=tokens,
        mask=mask,
        loss_mask=mask,
        old_logprobs=logprobs,
        advantages=np.asarray(advantages, np.float32).reshape(len(prompts), g),
    )


def _sample_response(out: dict) -> list[SampleResponse]:
    return [
        SampleResponse(
            [
                SampledSequence(
                    [int(t) for t in s["tokens"]],
                    [float(x) for x in s["logprobs"]],
                    s["stop_reason"],
                )
                for s in prompt
            ]
        )
        for prompt in out["sequences"]
    ]


class SamplingClient:
    """Samples from ``model_path``: a ``save_weights_for_sampler`` path, or ``"base"``."""

    def __init__(self, service: ServiceClient, model_path: str, *, parallel: int = 4):
        self.service, self.model_path = service, model_path
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="relax-sampler")

    def _body(self, prompts, num_samples: int, sampling_params: SamplingParams) -> dict:
        params = {k: v for k, v in dataclasses.asdict(sampling_params).items() if v is not None}
        return {
            "model_path": self.model_path,
            "num_samples": num_samples,
            "sampling_params": params,
            "prompts": [
                np.asarray(p.tokens if isinstance(p, ModelInput) else p, np.int32) for p in prompts
            ],
        }

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = SamplingParams(),
    ) -> Future:
        """Future of a ``SampleResponse``: ``num_samples`` sequences (tokens, log-probs, stop reason)."""
        body = self._body([prompt], num_samples, sampling_params)
        return self._pool.submit(
            lambda: _sample_response(self.service.call("POST", "/v1/sample", body))[0]
        )

    def sample_many(
        self,
        prompts: list[ModelInput],
        num_samples: int = 1,
        sampling_params: SamplingParams = SamplingParams(),
    ) -> Future:
        """Future of one ``SampleResponse`` per prompt, all sampled in one batch (relax's addition:
        one decode for the whole batch, as a trainer's rollout)."""
        body = self._body(prompts, num_samples, sampling_params)
        return self._pool.submit(
            lambda: _sample_response(self.service.call("POST", "/v1/sample", body))
        )
