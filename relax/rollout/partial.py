"""Partial rollouts: a batch is sampled over K rollouts, so no rollout waits for a batch's
longest completion (``relax.train.pipeline.AsyncConfig.partial``).

With completion budget ``N`` and chunk ``c = N / K``, the rollout of update ``i``
(``PartialRollouts.produce``) samples one chunk for every batch in progress::

    rollout i:   batch i+K-1 starts: its prompts prefilled, G completions of c tokens each;
                 batches i+1 .. i+K-2 continue: every unfinished completion by c tokens;
                 batch i continues by its last c tokens: every completion has now stopped or
                 holds N tokens, and batch i is the batch of update i.

Each call decodes at most ``c`` steps for the new batch and ``c`` for the continued rows (two
programs, one after the other), instead of the ``N`` steps of one batch whose rows mostly
finished early. A completion's chunks are sampled on the weights of the rollouts that sampled
them, ``v(j)`` for rollout ``j``: every token records its version (``versions``) and its
behaviour log-prob (``logprobs``), and the loss's off-policy correction weighs each token by its
own (``relax.objectives.off_policy``). Batches keep the data
order: batch ``i`` is the ``i``-th data batch. The first rollout makes K calls (every call
starts one batch), all on version 0; every later rollout makes one.

A completion continues with its KV cache **recomputed**: its prompt and the tokens it has so far
are prefilled as the prompt of a one-completion row (left-padded to a multiple of the chunk; the
rows padded to a power of two), under the weights of the continuing version, so each new token is
exactly that version's sample given the text so far. Keeping the cache instead would carry
``[rows, layers, N]`` keys and values from rollout to rollout (and into checkpoints), and make
the new tokens a mixture of two versions (keys and values of the old prefix from the old
weights); not built. The recomputed prefix costs a prefill per continuing row and chunk
(RESULTS.md measures it).

State: the data iterator's position and every batch in progress (``get_state`` / ``set_state``,
JSON, arrays base64-encoded), so a checkpoint resumes the exact rollouts.

On a mesh (``relax.parallel``) both programs run where the sampler's weights are laid out, traced
under their mesh, the rows split over its batch axes (the continued rows padded to a multiple of
the batch shards too): every row samples with the key of its index, as on one device (jax's
partitionable threefry: a row's key does not depend on the row count), so the tokens are one
device's. On several processes each batch's prompts and host records are gathered
from every process's rows when it starts and the sampled chunks fetched whole, so every process
holds the same batches in progress (the checkpoint, written by process 0, holds them all); the
batch ``produce`` hands on is this process's rows (``InProgress.local``), as its data iterator
would have given them.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from relax.models.config.sharding import BATCH_AXES, batch_shards, mesh_of
from relax.rollout.sampler import Rollout, RolloutConfig, compiled_generate, validate

UNSAMPLED = -1  # ``versions`` of a slot no token was sampled into


class PartialRequest(NamedTuple):
    """What the pipeline hands the partial rollout stage for update ``index`` (``__next__``)."""

    index: int


@dataclasses.dataclass
class InProgress:
    """One batch being sampled: its prompts (``[P, Lp]``, left-padded; every process's rows), the
    host ``records`` of every process's rows, in process order (opaque: the prompts' text and
    columns; one on one process) and its completions so far ``[P, G, N]``."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    records: tuple
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    chunks: int = 0

    @classmethod
    def start(cls, prompt_ids, prompt_mask, records, g: int, n: int, pad_id: int) -> InProgress:
        p = prompt_ids.shape[0]
        return cls(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            prompt_mask=np.asarray(prompt_mask, np.int32),
            records=tuple(records),
            tokens=np.full((p, g, n), pad_id, np.int32),
            logprobs=np.zeros((p, g, n), np.float32),
            versions=np.full((p, g, n), UNSAMPLED, np.int32),
            lengths=np.zeros((p, g), np.int32),
            finished=np.zeros((p, g), bool),
        )

    @property
    def record(self) -> Any:
        """This process's host record (of its rows)."""
        return self.records[jax.process_index()]

    def local(self) -> InProgress:
        """This process's rows (its contiguous share of the prompts, as ``relax.data.prompts``
        deals them): what its host stages score; the batch itself on one process."""
        n = jax.process_count()
        if n == 1:
            return self
        share = self.prompt_ids.shape[0] // n
        rows = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
        return dataclasses.replace(self, **{f: getattr(self, f)[rows] for f in _ARRAYS})

    @property
    def running(self) -> np.ndarray:
        """``[P, G]``: completions still sampling (no stop token yet, under the budget)."""
        return ~self.finished & (self.lengths < self.tokens.shape[2])

    @property
    def mask(self) -> np.ndarray:
        """``[P, G, N]``: 1 on every sampled token (up to and including the stop token)."""
        return (np.arange(self.tokens.shape[2]) < self.lengths[..., None]).astype(np.int32)

    def write(self, p: int, g: int, tokens, logprobs, mask, finished: bool, version: int) -> None:
        """Append a chunk's sampled tokens (``mask``) to completion ``(p, g)``."""
        start, k = int(self.lengths[p, g]), int(mask.sum())
        self.tokens[p, g, start : start + k] = tokens[:k]
        self.logprobs[p, g, start : start + k] = logprobs[:k]
        self.versions[p, g, start : start + k] = version
        self.lengths[p, g] += k
        self.finished[p, g] |= bool(finished)

    def write_first(self, tokens, logprobs, mask, finished, version: int) -> None:
        """The first chunk of every completion (``[P, G, c]``, the sampler's outputs)."""
        c = tokens.shape[2]
        self.tokens[..., :c], self.logprobs[..., :c] = tokens, logprobs
        self.versions[..., :c] = np.where(mask > 0, version, UNSAMPLED)
        self.lengths[:], self.finished[:] = mask.sum(-1), finished
        self.chunks = 1


def _encode_array(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x)
    return {
        "dtype": x.dtype.str,
        "shape": list(x.shape),
        "data": base64.b64encode(x.tobytes()).decode("ascii"),
    }


def _decode_array(d: dict) -> np.ndarray:
    return (
        np.frombuffer(base64.b64decode(d["data"], validate=True), np.dtype(d["dtype"]))
        .reshape(d["shape"])
        .copy()
    )


_ARRAYS = ("prompt_ids", "prompt_mask", "tokens", "logprobs", "versions", "lengths", "finished")


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _dispatch(cfg: RolloutConfig, policy, ids: np.ndarray, mask: np.ndarray, key) -> Rollout:
    """``compiled_generate(cfg)`` on host prompts ``ids`` / ``mask`` (every row, the same on every
    process), dispatched where the weights are: on their mesh traced under it, the rows split over
    its batch axes and the key replicated, as a sharded rollout runs (``relax.parallel``). Rows
    that do not split over the batch axes are an error naming them."""
    mesh = mesh_of(policy)
    if mesh is None:
        return compiled_generate(cfg)(policy, ids, mask, key)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    if ids.shape[0] % batch_shards(mesh):
        sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise ValueError(
            f"{ids.shape[0]} prompts do not split over the batch axes {sizes} of the mesh the "
            f"weights sample on; use a batch size divisible by {batch_shards(mesh)}"
        )
    rows = NamedSharding(mesh, PartitionSpec(axes))
    put = lambda x: jax.make_array_from_callback(x.shape, rows, lambda i: x[i])  # noqa: E731
    key = jax.device_put(key, NamedSharding(mesh, PartitionSpec()))
    with jax.set_mesh(mesh):
        return compiled_generate(cfg)(policy, put(ids), put(mask), key)


def _to_host(tree):
    """``tree``'s arrays whole, as numpy, on every process (an array over several processes'
    devices is gathered: every process calls this)."""
    return jax.tree.map(
        lambda x: (
            np.asarray(x)
            if x.is_fully_addressable
            else multihost_utils.process_allgather(x, tiled=True)
        ),
        tree,
    )


def _gather_json(value) -> list:
    """Every process's JSON value ``value``, in process order (every process calls this)."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int64(data.size))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]


class PartialRollouts:
    """The batches in progress and the data they come from (module docstring).

    ``batches``: the data iterator (``get_state``/``set_state``); ``to_prompts(item)`` ->
    ``(prompt_ids [P, Lp], prompt_mask, record)``; ``encode(record)`` / ``decode(json)``: a
    record to JSON and back (checkpoints). ``cfg``: the sampler's config over the whole budget;
    ``k``: the rollouts a batch is sampled over (``cfg.max_new_tokens`` a multiple of it).

    It stands in for the data iterator of a pipelined run: ``next()`` is a ``PartialRequest``,
    and the rollout stage calls ``produce`` with the sampler's weights."""

    def __init__(
        self,
        batches,
        to_prompts: Callable,
        cfg: RolloutConfig,
        k: int,
        *,
        encode: Callable[[Any], Any] = lambda r: r,
        decode: Callable[[Any], Any] = lambda r: r,
    ):
        if k < 2:
            raise ValueError(f"partial rollouts sample a batch over k >= 2 rollouts, got {k}")
        if cfg.max_new_tokens % k:
            raise ValueError(
                f"--async.partial {k} must divide the completion budget max_new_tokens="
                f"{cfg.max_new_tokens} (every rollout samples max_new_tokens / {k} tokens)"
            )
        self.batches, self.to_prompts, self.cfg, self.k = batches, to_prompts, cfg, k
        self.encode, self.decode = encode, decode
        self.chunk = cfg.max_new_tokens // k
        self.fresh_cfg = dataclasses.replace(cfg, max_new_tokens=self.chunk, record_routes=False)
        self.cont_cfg = dataclasses.replace(self.fresh_cfg, num_generations=1)
        self.in_progress: collections.deque[InProgress] = collections.deque()
        self.requested = 0  # PartialRequests handed out
        self.produced = 0  # batches emitted
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ the data iterator's part

    def __iter__(self):
        return self

    def __next__(self) -> PartialRequest:
        self.requested += 1
        return PartialRequest(self.requested - 1)

    def get_state(self) -> dict:
        data = self.batches.get_state()
        data = (
            {"bytes": base64.b64encode(bytes(data)).decode("ascii")}
            if isinstance(data, (bytes, bytearray))
            else {"json": data}
        )
        return {
            "data": data,
            "produced": self.produced,
            "in_progress": [
                {
                    "chunks": b.chunks,
                    "records": [self.encode(r) for r in b.records],
                    **{f: _encode_array(getattr(b, f)) for f in _ARRAYS},
                }
                for b in self.in_progress
            ],
        }

    def set_state(self, state: dict) -> None:
        data = state["data"]
        self.batches.set_state(base64.b64decode(data["bytes"]) if "bytes" in data else data["json"])
        self.in_progress = collections.deque(
            InProgress(
                # "record": a checkpoint written before several processes were served
                records=tuple(self.decode(r) for r in b.get("records", [b.get("record")])),
                chunks=b["chunks"],
                **{f: _decode_array(b[f]) for f in _ARRAYS},
            )
            for b in state["in_progress"]
        )
        self.produced = self.requested = state["produced"]

    # ------------------------------------------------------------------ sampling

    def running_rows(self) -> list[tuple[InProgress, int, int]]:
        """``(batch, p, g)`` of every completion still sampling, oldest batch first."""
        return [
            (b, int(p), int(g)) for b in self.in_progress for p, g in zip(*np.nonzero(b.running))
        ]

    def continuation_prompts(self, rows: list[tuple[InProgress, int, int]], shards: int = 1):
        """The rows' prompts: each completion's prompt and tokens so far, left-padded to the next
        multiple of the chunk (rows hold multiples of it); the row count padded to a power of two,
        then to a multiple of ``shards`` (the sampler mesh's batch shards; the padding rows repeat
        row 0)."""
        seqs = [
            np.concatenate(
                [b.prompt_ids[p][b.prompt_mask[p] > 0], b.tokens[p, g, : b.lengths[p, g]]]
            )
            for b, p, g in rows
        ]
        width = (
            -(-max(len(s) for s in seqs) // self.chunk) * self.chunk
        )  # a multiple of the chunk: few shapes
        r = -(-_pow2(len(seqs)) // shards) * shards
        ids = np.full((r, width), self.cfg.pad_id, np.int32)
        mask = np.zeros((r, width), np.int32)
        for i in range(r):
            s = seqs[i if i < len(seqs) else 0]
            ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
        return ids, mask

    def new_batch(self, policy, item) -> InProgress:
        """A new batch of data item ``item``: its prompts checked (the whole budget fits the
        model's context) and, on several processes, gathered from every process's rows."""
        ids, mask, record = self.to_prompts(item)
        if jax.process_count() == 1:
            records = (record,)
        else:
            ids, mask = (
                multihost_utils.process_allgather(np.asarray(x), tiled=True) for x in (ids, mask)
            )
            records = tuple(self.decode(r) for r in _gather_json(self.encode(record)))
        validate(policy, ids, mask, self.cfg)
        return InProgress.start(
            ids, mask, records, self.cfg.num_generations, self.cfg.max_new_tokens, self.cfg.pad_id
        )

    def _call(self, policy, version: int, key, fresh) -> dict[str, float]:
        """One chunk for every batch in progress and, when ``fresh`` (a data item), a new batch:
        two programs, the new batch's dispatched first, then the continued rows'."""
        rows = self.running_rows()
        stats = {"continued_rows": float(len(rows)), "prefill_tokens": 0.0}
        started = None
        if fresh is not None:
            started = self.new_batch(policy, fresh)
            new = _dispatch(
                self.fresh_cfg,
                policy,
                started.prompt_ids,
                started.prompt_mask,
                jax.random.fold_in(key, 0),
            )
        if rows:
            mesh = mesh_of(policy)
            ids, mask = self.continuation_prompts(rows, 1 if mesh is None else batch_shards(mesh))
            stats["prefill_tokens"] = float(mask[: len(rows)].sum())
            cont = _to_host(_dispatch(self.cont_cfg, policy, ids, mask, jax.random.fold_in(key, 1)))
            for i, (b, p, g) in enumerate(rows):
                b.write(
                    p,
                    g,
                    cont.tokens[i, 0],
                    cont.logprobs[i, 0],
                    cont.mask[i, 0],
                    cont.finished[i, 0],
                    version,
                )
        for b in self.in_progress:
            b.chunks += 1
        if started is not None:
            new = _to_host(new)
            started.write_first(new.tokens, new.logprobs, new.mask, new.finished, version)
            self.in_progress.append(started)
        return stats

    def produce(self, policy, version: int, key, request: PartialRequest) -> InProgress:
        """The complete batch of update ``request.index`` (this process's rows of it), sampling on
        ``policy`` (version ``version``, keys from ``key``; on whatever mesh its weights are): one
        call, or K on the first rollout (module docstring)."""
        if request.index != self.produced:
            raise RuntimeError(
                f"partial rollout {request.index} requested, but {self.produced} is next: the "
                "pipeline must produce batches in order"
            )
        calls, totals = 0, collections.Counter()
        while not self.in_progress or self.in_progress[0].chunks < self.k:
            fresh = next(self.batches, None)
            if fresh is None and not self.in_progress:
                raise StopIteration("the data iterator is exhausted and no batch is in progress")
            totals.update(self._call(policy, version, jax.random.fold_in(key, calls), fresh))
            calls += 1
        done = self.in_progress.popleft()
        if done.running.any():
            raise RuntimeError(
                f"batch {self.produced} has unfinished completions after {self.k} rollouts"
            )
        self.produced += 1
        chunked = (done.versions != done.versions[..., :1]) & (done.versions != UNSAMPLED)
        self.last = {
            "partial/calls": float(calls),
            **{f"partial/{k}": float(v) for k, v in sorted(totals.items())},
            "partial/in_progress": float(len(self.in_progress)),
            "partial/mixed_version_frac": float(chunked.any(-1).mean()),
        }
        return done.local()
