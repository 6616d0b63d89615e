"""Reference log-probs computed once for a whole dataset and saved beside the data.

With a reference that never changes (DPO's, KTO's), its log-probs of every example are the same in
every epoch: ``precompute_reference`` computes them once (``dataset_reference_logps``: fixed-shape
batches, one jitted prefix-shared forward each), saves them, and training reads them from the
batch instead of keeping a reference model (TRL's ``precompute_ref_log_probs``).

The cache is one safetensors file (``default_cache_path``: ``<data file>.<kind>-reference.safetensors``
beside a single data file, ``<kind>-reference.safetensors`` inside a data directory) holding
``logps`` float32 ``[n, 2]`` (pairs: chosen, rejected; unpaired: completion, KL completion), row
``i`` for example ``i`` in data order. Its metadata is the key the logps are valid for:

- ``data``: the data files' fingerprints (``relax.train.fingerprint`` of each file's bytes), so an
  edited file is never silently reused;
- ``tokens``: a SHA-256 of the encoded examples (a different tokenizer, budget or truncation);
- ``model``: a SHA-256 of the reference model's fingerprint;
- ``kind`` and ``n``.

``load_cache`` raises ``StaleCacheError`` naming what changed; ``cached_reference_logps`` loads a
matching cache and otherwise computes and (over)writes it. Compute the cache over every example
in data order, before any train / eval split, so that both parts find theirs.

An offline run does so in its ``prepare`` hook (``reference_preparer``): with
``precompute_reference``, the training and held-out examples' log-probs are computed (or loaded)
together, once, and attached to the examples (``relax.data.pairs.with_reference``), so their
batches carry ``ref_logps``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.preference.pairs import sequence_logps
from relax.data.files import PathLike, resolve_files
from relax.data.pairs import Pair, Unpaired, collate_pairs, collate_unpaired, with_reference
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.passes import Passes, choose_passes
from relax.train.fingerprint import fingerprint
from relax.train.update import forward_groups

FORMAT = "relax-reference-logps/1"


class StaleCacheError(ValueError):
    """A reference cache exists but was made for other data, tokens or another reference model."""


def _kind(examples: Sequence[Pair | Unpaired]) -> str:
    if examples and all(isinstance(e, Pair) for e in examples):
        return "pairs"
    if examples and all(isinstance(e, Unpaired) for e in examples):
        return "unpaired"
    raise TypeError("examples must be a non-empty list of Pair or of Unpaired (relax.data.pairs)")


def default_cache_path(data_path: PathLike | Sequence[PathLike], kind: str) -> Path:
    """Where the cache of ``data_path``'s ``kind`` ("pairs" | "unpaired") examples lives."""
    single = isinstance(data_path, (str, os.PathLike))
    first = Path(data_path if single else list(data_path)[0])
    if single and first.is_dir():
        return first / f"{kind}-reference.safetensors"
    files = resolve_files(data_path)
    name = files[0].name + (f"+{len(files) - 1}" if len(files) > 1 else "")
    return files[0].with_name(f"{name}.{kind}-reference.safetensors")


def data_fingerprint(data_path: PathLike | Sequence[PathLike]) -> dict[str, list[int]]:
    """``{file name: fingerprint of its bytes}`` for each data file (``relax.train.fingerprint``)."""
    out = {}
    for f in resolve_files(data_path):
        record = fingerprint({"bytes": np.fromfile(f, np.uint8)})
        out[f.name] = record["bytes"]
    return out


def tokens_digest(examples: Sequence[Pair | Unpaired]) -> str:
    """SHA-256 of the examples' token ids (and labels): what the log-probs were computed for."""
    h = hashlib.sha256()
    for e in examples:
        seqs = (
            (e.prompt, e.chosen, e.rejected)
            if isinstance(e, Pair)
            else (e.prompt, e.completion, e.kl_completion, [int(e.desirable)])
        )
        for s in seqs:
            h.update(np.asarray([len(s), *s], np.int64).tobytes())
    return h.hexdigest()


def model_digest(model) -> str:
    """SHA-256 of the model's fingerprint (``relax.train.fingerprint``) and dtypes / shapes."""
    shapes = [f"{x.dtype}{x.shape}" for x in jax.tree.leaves(model)]
    return hashlib.sha256(
        json.dumps([fingerprint(model), shapes], sort_keys=True).encode()
    ).hexdigest()


def cache_key(data_path, examples, model) -> dict[str, str]:
    """The metadata a cache is valid for (module docstring)."""
    return {
        "format": FORMAT,
        "kind": _kind(examples),
        "n": str(len(examples)),
        "data": json.dumps(data_fingerprint(data_path), sort_keys=True),
        "tokens": tokens_digest(examples),
        "model": model_digest(model),
    }


_WHAT = {
    "format": "the cache format",
    "kind": "the kind of examples",
    "n": "the number of examples",
    "data": "the data file",
    "tokens": "the tokenized examples (tokenizer, budgets or truncation)",
    "model": "the reference model",
}


def save_cache(path: PathLike, logps: np.ndarray, key: dict[str, str]) -> Path:
    """Write ``logps [n, 2]`` with ``key`` as metadata (a temporary file, then a rename)."""
    from safetensors.numpy import save_file

    path = Path(path)
    logps = np.ascontiguousarray(logps, np.float32)
    if logps.ndim != 2 or logps.shape[1] != 2 or str(logps.shape[0]) != key["n"]:
        raise ValueError(f"logps {logps.shape} must be [n, 2] with n = {key['n']}")
    tmp = path.with_name(path.name + ".tmp")
    save_file({"logps": logps}, str(tmp), metadata=dict(key))
    os.replace(tmp, path)
    return path


def load_cache(path: PathLike, key: dict[str, str]) -> np.ndarray:
    """The cached ``logps [n, 2]``; ``StaleCacheError`` naming what differs from ``key``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        changed = [k for k in _WHAT if meta.get(k) != key.get(k)]
        if changed:
            raise StaleCacheError(
                f"reference cache {path} is stale: {' and '.join(_WHAT[k] for k in changed)} "
                "changed"
            )
        return np.asarray(f.get_tensor("logps"), np.float32)


def dataset_reference_logps(
    model,
    examples: Sequence[Pair | Unpaired],
    *,
    batch_size: int,
    pad_id: int,
    prompt_length: int,
    completion_length: int,
    passes: Passes | None = None,
    train_attention: str = "auto",
) -> np.ndarray:
    """``[n, 2]`` sequence log-probs of ``model`` for every example (pairs: chosen, rejected;
    unpaired: completion, KL completion), in batches of ``batch_size`` of one fixed shape (the last
    one filled up with copies of its first example, whose results are dropped): one compile."""
    kind = _kind(examples)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    passes = choose_passes() if passes is None else passes
    collate = collate_pairs if kind == "pairs" else collate_unpaired
    p = batch_size

    @jax.jit
    def forward(model, prompt_ids, prompt_mask, tokens, mask):
        groups = forward_groups(passes, {"tokens": tokens})
        how = ForwardPass(attention=train_attention, groups_per_pass=groups)
        logp = completion_logprobs(model, prompt_ids, prompt_mask, tokens, mask, how)
        return sequence_logps(logp, mask)[0]

    out = []
    for start in range(0, len(examples), p):
        chunk = list(examples[start : start + p])
        real = len(chunk)
        chunk += [chunk[0]] * (p - real)
        b = collate(
            chunk, pad_id=pad_id, prompt_length=prompt_length, completion_length=completion_length
        )
        arrays = (jnp.asarray(x) for x in (b.prompt_ids, b.prompt_mask, b.tokens, b.mask))
        out.append(
            forward(model, *arrays)[:real]
        )  # device arrays: the next batch is collated meanwhile
    return np.concatenate([np.asarray(x) for x in out]).astype(np.float32)


def cached_reference_logps(
    model,
    examples: Sequence[Pair | Unpaired],
    data_path: PathLike | Sequence[PathLike],
    *,
    batch_size: int,
    pad_id: int,
    prompt_length: int,
    completion_length: int,
    passes: Passes | None = None,
    train_attention: str = "auto",
    path: PathLike | None = None,
) -> tuple[np.ndarray, str]:
    """``(logps [n, 2], status)``: the cache at ``path`` (default ``default_cache_path``) when its
    key matches, else computed (``dataset_reference_logps``) and saved there. ``status``: ``"loaded"``,
    ``"computed"`` (no cache yet) or ``"recomputed: <why the old one was stale>"``."""
    key = cache_key(data_path, examples, model)
    path = Path(path) if path is not None else default_cache_path(data_path, key["kind"])
    status = "computed"
    if path.exists():
        try:
            return load_cache(path, key), "loaded"
        except StaleCacheError as e:
            status = f"recomputed: {e}"
    logps = dataset_reference_logps(
        model,
        examples,
        batch_size=batch_size,
        pad_id=pad_id,
        prompt_length=prompt_length,
        completion_length=completion_length,
        passes=passes,
        train_attention=train_attention,
    )
    save_cache(path, logps, key)
    return logps, status


def precompute(cfg, model, examples: list, data_paths: list[str], tokenizer, log=print) -> list:
    """``examples`` with their reference log-probs attached (``relax.data.pairs.with_reference``),
    cached beside the data (``cached_reference_logps``, 8 examples per forward). ``cfg``: a
    preference config (``relax.algorithms.preference.config``): the batch shape and attention."""
    logps, status = cached_reference_logps(
        model,
        examples,
        data_paths,
        batch_size=8,
        pad_id=tokenizer.pad_token_id,
        prompt_length=cfg.max_prompt_tokens,
        completion_length=cfg.max_completion_tokens,
        train_attention=cfg.forward.train_attention,
    )
    log(f"reference log-probs of {len(examples)} examples: {status}")
    return with_reference(examples, logps)


def reference_preparer(cfg):
    """``OfflineAlgorithm.prepare`` for a DPO or KTO config: with ``precompute_reference``, the
    reference log-probs of the training and held-out examples computed together, once, and
    cached beside the data (held-out data as ``(records, examples)``); else nothing to do."""

    def prepare(model, train, held_out, paths, tokenizer):
        if not cfg.precompute_reference:
            return train, held_out
        if held_out is None:
            return precompute(cfg, model, train, paths, tokenizer), None
        records, examples = held_out
        both = precompute(cfg, model, train + examples, paths, tokenizer)
        return both[: len(train)], (records, both[len(train) :])

    return prepare
