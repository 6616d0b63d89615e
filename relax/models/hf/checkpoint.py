"""Hugging Face checkpoints (``config.json`` + safetensors) <-> relax :class:`Transformer`.

    model = load_pretrained("path/to/Qwen3-0.6B")          # float32 compute, params as stored
    save_pretrained(model, "out/", max_shard_bytes=2**30)  # loadable by transformers

Conventions at the boundary:

- Tensor names are transformers' (``model.embed_tokens.weight``,
  ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``),
  per layer as the family's record says (``relax.models.config.families``). Torch ``Linear`` weights
  are ``[out, in]``; relax stores ``[in, out]`` with the layers stacked on a leading ``[L]``
  axis, so loading transposes and stacks, saving unstacks and transposes. A fused tensor (Phi-3's
  ``qkv_proj``, ``gate_up_proj``) is cut along its output axis into its fields on load (q, k, v;
  gate, up) and concatenated back on save.
- Mixtures of experts: a field is stacked over the layers that have it
  (``ModelConfig.layer_count``): the dense MLP's tensors exist on the dense layers only, the
  experts' on the sparse layers only. A per-expert tensor (``...experts.{e}.gate_proj.weight``,
  one per expert ``e``) is stacked on relax's ``[E]`` axis after the layer's: ``[Ls, E, in, out]``.
- Safetensors are parsed by ``relax.models.hf.weights_io`` (8-byte little-endian header length, JSON
  header, raw data), not through a framework, so bfloat16 loads as ``ml_dtypes.bfloat16`` and a
  save -> load round trip is bit-exact. Pickles (``pytorch_model.bin``, ``*.pt``) are never read.
- ``param_dtype=None`` keeps each tensor's stored dtype (float64 becomes float32).
- Tied models: ``lm_head.weight`` is not written. On load a stored ``lm_head.weight`` equal to
  the embedding is ignored; one that differs is kept and the model is untied (with a warning),
  which is what transformers 5.23 does, so logits match it.
- ``generation_config.json`` (when present) supplies ``eos_token_id`` (it usually lists every
  stop token, e.g. Llama 3's ``<|eot_id|>``), and ``bos``/``pad`` where ``config.json`` has none.
- Before any tensor is read, the config is checked against the safetensors headers
  (``relax.models.hf.validate``: vocabulary, hidden size, layer and expert counts, the first
  layers' shapes), so an absurd or mismatched ``config.json`` fails at once, naming the field;
  building the layout is linear in the number of tensors (``relax.models.hf.layout``).
- Saving is atomic: a new directory is staged next to ``path`` and renamed; into an existing
  directory, ``config.json`` is removed first and written last, so a crash never leaves a
  directory with a ``config.json`` whose weights are half-written.

Every error about a checkpoint is an :class:`HFFormatError` naming the file and tensor or field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from relax.models.config.model import ModelConfig
from relax.models.config.precision import Precision
from relax.models.decoder.transformer import LayerStack, Transformer
from relax.models.hf.config import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    dtype_name,
    generation_config_to_hf,
    with_generation_config,
)
from relax.models.hf.layout import layout, split_fused
from relax.models.hf.validate import check_checkpoint
from relax.models.hf.weights_io import (
    FLOAT_DTYPES,
    INDEX,
    WEIGHTS,
    SafetensorsFile,
    open_weights,
    read_json,
    write_json,
    write_safetensors,
)

__all__ = ["HFFormatError", "config_from_hf", "config_to_hf", "load_pretrained", "save_pretrained"]

CONFIG = "config.json"
GENERATION = "generation_config.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers some old checkpoints carry


# ----------------------------------------------------------------------------- load


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    max_positions: int | None = None,
    precision: Precision | None = None,
) -> Transformer:
    """A :class:`Transformer` from a Hugging Face directory (``config.json`` + safetensors).

    ``dtype`` is the compute dtype; ``param_dtype`` casts every parameter (None: as stored);
    ``precision`` what stays float32 besides (``relax.models.config.precision``; None: the default).
    ``max_positions`` caps the model's context below the file's ``max_position_embeddings`` (a
    Phi-3 LongRoPE model whose context exceeds its original length needs it: ``hf_config``).

    Args:
        path: a local model directory with ``config.json`` and ``model.safetensors`` or sharded
            safetensors with their index; ``generation_config.json`` is read when present.
            Nothing is downloaded.
        dtype: the compute dtype (default float32).
        param_dtype: the dtype every parameter is cast to. None (default): as stored (float64
            becomes float32).
        max_positions: the model's context, in ``[1, file's max_position_embeddings]``. None
            (default): the file's.
        precision: the precision policy the model carries (None: ``Precision()``).

    Returns:
        A ``Transformer`` with the checkpoint's ``ModelConfig`` and weights (``lm_head`` None when
            the embeddings are tied). A missing, extra, misshapen, non-float or non-finite tensor
            raises ``HFFormatError``.
    """
    root = Path(path)
    cfg = load_config(root, max_positions=max_positions)
    where, listing = open_weights(root)
    model = build_transformer(cfg, where, listing, dtype=dtype, param_dtype=param_dtype)
    return model if precision is None else dataclasses.replace(model, precision=precision)


def read_config(path: str | os.PathLike, *, max_positions: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a model directory, or of a ``config.json`` file alone (with the
    ``generation_config.json`` beside it when there is one): no weights are read. ``max_positions``
    as ``load_pretrained``'s."""
    path = Path(path)
    if path.is_dir():
        return load_config(path, max_positions=max_positions)
    if not path.is_file():
        raise HFFormatError(f"{path}: neither a model directory nor a config.json file")
    cfg = config_from_hf(read_json(path), source=str(path), max_positions=max_positions)
    if (path.parent / GENERATION).is_file():
        cfg = with_generation_config(
            cfg, read_json(path.parent / GENERATION), source=str(path.parent / GENERATION)
        )
    return cfg


def load_config(
    root: Path,
    adapt: Callable[[dict, str], dict] | None = None,
    *,
    max_positions: int | None = None,
) -> ModelConfig:
    """The :class:`ModelConfig` of a model directory (``config.json``, then ``generation_config.json``);
    ``adapt(parsed config.json, its path)`` may rewrite the parsed dict first (``read_config`` also
    takes a lone ``config.json``); ``max_positions`` as ``load_pretrained``'s."""
    cfg_path = root / CONFIG
    if not root.is_dir():
        raise HFFormatError(f"{root}: not a directory (expected a Hugging Face model directory)")
    if not cfg_path.is_file():
        raise HFFormatError(
            f"{cfg_path}: missing config.json (a Hugging Face model directory "
            "needs config.json and safetensors weights)"
        )
    d = read_json(cfg_path)
    cfg = config_from_hf(
        d if adapt is None else adapt(d, str(cfg_path)),
        source=str(cfg_path),
        max_positions=max_positions,
    )
    if (root / GENERATION).is_file():
        cfg = with_generation_config(
            cfg, read_json(root / GENERATION), source=str(root / GENERATION)
        )
    return cfg


def _check_finite(a: np.ndarray, name: str, path) -> None:
    """Raise ``HFFormatError`` naming the file and tensor when ``a`` holds a NaN or an infinity
    (such weights would load, train and export NaN)."""
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise HFFormatError(
            f"{path}: tensor {name!r} holds {int(bad.sum())} non-finite value(s) "
            f"(the first at index {list(first)}: {a[first]})"
        )


def _describe(cfg: ModelConfig) -> str:
    """``"qwen3_moe model with 3 layers (2 sparse: 4 experts)"``, for errors about its tensors."""
    moe = f" ({cfg.num_sparse_layers} sparse: {cfg.num_experts} experts)" if cfg.num_experts else ""
    return f"{cfg.family} model with {cfg.num_layers} layers{moe}"


def build_transformer(
    cfg: ModelConfig, where: dict[str, SafetensorsFile], listing: str, *, dtype, param_dtype
) -> Transformer:
    """The :class:`Transformer` of ``cfg`` from the tensors ``where`` (``open_weights``), every one of
    which must belong to it; ``listing`` is the file named when one is missing.

    ``cfg`` is first checked against the tensors' headers (``relax.models.hf.validate``: sizes,
    layer and expert counts, named by the ``config.json`` beside ``listing``), so an absurd or
    mismatched config fails before any per-layer work; then every tensor's name, shape and dtype,
    then their values."""
    check_checkpoint(cfg, where, listing, str(Path(listing).with_name(CONFIG)))
    has_head = "lm_head.weight" in where
    slots = layout(cfg, with_head=has_head or not cfg.tie_word_embeddings)
    expected = {s.name for s in slots}
    missing = [s.name for s in slots if s.name not in where]
    if missing:
        more = f" and {len(missing) - 1} more, e.g. {missing[1:4]}" if len(missing) > 1 else ""
        raise HFFormatError(
            f"{listing}: missing tensor {missing[0]!r}{more} for a {_describe(cfg)}"
        )
    extra = sorted(n for n in where if n not in expected and not _IGNORED.search(n))
    if extra:
        raise HFFormatError(
            f"{where[extra[0]].path}: unexpected tensor {extra[0]!r} (not part of a "
            f"{_describe(cfg)}"
            f"{f'; {len(extra)} unexpected in all' if len(extra) > 1 else ''})"
        )
    for s in slots:
        f = where[s.name]
        code, shape = f.entries[s.name][:2]
        if shape != s.hf_shape:
            raise HFFormatError(
                f"{f.path}: tensor {s.name!r} has shape {list(shape)}, expected {list(s.hf_shape)}"
            )
        if code not in FLOAT_DTYPES:
            raise HFFormatError(
                f"{f.path}: tensor {s.name!r} has dtype {code}; relax loads "
                f"floating-point weights only ({', '.join(FLOAT_DTYPES)})"
            )

    target = None if param_dtype is None else np.dtype(jnp.dtype(param_dtype))
    stacked = cfg.stacked_shapes()

    # field -> memory-mapped tensors, [in, out], in stack order
    views: dict[str, list[np.ndarray]] = {}
    for s in slots:
        a = where[s.name].read(s.name)
        _check_finite(a, s.name, where[s.name].path)
        for field, part in zip(s.fields, split_fused(a, s)):
            views.setdefault(field, []).append(part)

    def host(field: str) -> np.ndarray:
        """One private C-ordered copy (layers stacked on axis 0, then experts) in the target dtype."""
        vs = views[field]  # noqa: F821 (deleted after its last use below)
        if field in LayerStack.__dataclass_fields__:
            a = np.stack(vs).reshape(stacked[field])  # per-expert: [Ls * E, ...] -> [Ls, E, ...]
        else:
            a = np.array(vs[0], order="C")
        dt = (
            target
            if target is not None
            else (np.dtype(np.float32) if a.dtype == np.float64 else a.dtype)
        )
        return a.astype(dt, copy=False)

    by_field = {f: host(f) for f in views}
    if cfg.tie_word_embeddings and has_head:
        head, emb = by_field["lm_head"], by_field["embed"]
        if (
            np.array_equal(head.view(np.uint8), emb.view(np.uint8))
            if head.dtype == emb.dtype
            else np.array_equal(head.astype(np.float32), emb.astype(np.float32))
        ):
            del by_field["lm_head"]
        else:
            warnings.warn(
                f"{where['lm_head.weight'].path}: tie_word_embeddings is true but 'lm_head.weight' "
                "differs from 'model.embed_tokens.weight'; keeping both and untying the model "
                "(as transformers does)",
                stacklevel=3,
            )
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    del views
    arrays = {f: jnp.asarray(by_field.pop(f)) for f in list(by_field)}
    layers = LayerStack(**{f: arrays[f] for f in cfg.layer_shapes()})
    return Transformer(
        embed=arrays["embed"],
        layers=layers,
        norm=arrays["norm"],
        lm_head=arrays.get("lm_head"),
        config=cfg,
        dtype=dtype,
    )


# ----------------------------------------------------------------------------- save


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (best effort: not every platform can fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_pretrained(
    model: Transformer, path: str | os.PathLike, *, max_shard_bytes: int | None = None, dtype=None
) -> None:
    """Write ``model`` as a transformers-loadable directory.

    ``config.json``, ``generation_config.json`` (bos/eos/pad) and either
    ``model.safetensors`` or, when the tensors exceed ``max_shard_bytes``, shards
    ``model-XXXXX-of-YYYYY.safetensors`` plus ``model.safetensors.index.json``. ``dtype``
    casts the parameters (None: as they are; a round trip is then bit-exact).

    Args:
        model: a ``Transformer`` without LoRA adapters (save ``merge_lora(model)``, or the
            adapters alone with ``relax.models.adapters.peft.save_adapter``).
        path: the directory to write. It is created (with its parents) when absent; an
            existing one has its weights, index and configs replaced, other files kept.
        max_shard_bytes: the most bytes per shard file; a tensor larger than that gets a
            shard of its own. None (default): one ``model.safetensors``.
        dtype: the dtype the parameters are written in. None (default): as they are.

    Returns:
        None. The files are written to a staging directory first and then moved into place.
    """
    save_directory(model, path, max_shard_bytes=max_shard_bytes, dtype=dtype)


def save_directory(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    dtype=None,
    extra: dict[str, np.ndarray] | None = None,
    hf_fields: dict | None = None,
    tensor_name: Callable[[str], str] | None = None,
    config_json: Callable[[dict], dict] | None = None,
) -> None:
    """``save_pretrained`` plus ``extra`` tensors (Hugging Face name -> array, written after the
    model's, cast like them) and ``hf_fields`` set in ``config.json`` (e.g. another architecture);
    ``tensor_name`` renames the model's tensors (e.g. under a vision-language model's prefix) and
    ``config_json`` rewrites the ``config.json`` dict last (e.g. nests it as a ``text_config``)."""
    cfg = model.config
    if model.layers.lora is not None:
        raise ValueError(
            "the model has LoRA adapters: save merge_lora(model) (relax.models.adapters.operations) for full "
            "weights, or its adapters with relax.models.adapters.peft.save_adapter"
        )
    if (model.lm_head is None) != cfg.tie_word_embeddings:
        raise ValueError(
            f"model.lm_head is {'None' if model.lm_head is None else 'set'} but "
            f"config.tie_word_embeddings={cfg.tie_word_embeddings}"
        )
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    cast = None if dtype is None else np.dtype(jnp.dtype(dtype))
    arrays: dict[str, np.ndarray] = {}

    def field_array(field: str, stacked: bool) -> np.ndarray:
        if field not in arrays:
            a = np.asarray(getattr(model.layers if stacked else model, field))
            dtype_name(a.dtype)  # raises for a non-float parameter
            arrays[field] = a if cast is None else a.astype(cast)
        return arrays[field]

    hf_config = config_to_hf(
        cfg, cast if cast is not None else field_array("embed", False).dtype
    )  # checks cfg first
    specs = []
    for s in layout(cfg, with_head=not cfg.tie_word_embeddings):
        parts = [field_array(f, s.index is not None) for f in s.fields]
        if len({a.dtype for a in parts}) > 1:
            raise ValueError(
                f"{s.name} fuses {list(s.fields)}, whose dtypes differ: {[str(a.dtype) for a in parts]}"
            )

        def make(parts=parts, s=s):
            xs = [a if s.index is None else a[s.index] for a in parts]
            x = (
                xs[0] if len(xs) == 1 else np.concatenate(xs, axis=-1)
            )  # a fused tensor: along the output axis
            return x.T if s.transpose else x

        name = s.name if tensor_name is None else tensor_name(s.name)
        specs.append((name, s.hf_shape, parts[0].dtype, make))
    for name, a in (extra or {}).items():
        dtype_name(a.dtype)  # raises for a non-float tensor
        a = a if cast is None else a.astype(cast)
        specs.append((name, a.shape, a.dtype, lambda a=a: a))
    nbytes = lambda spec: math.prod(spec[1]) * spec[2].itemsize
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        if max_shard_bytes is not None and shards[-1] and size + nbytes(spec) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec)
    n = len(shards)
    names = [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index = (
        None
        if n == 1
        else {
            "metadata": {"total_size": sum(map(nbytes, specs))},
            "weight_map": {spec[0]: name for name, shard in zip(names, shards) for spec in shard},
        }
    )
    hf_config.update(hf_fields or {})
    hf_config = hf_config if config_json is None else config_json(hf_config)
    generation = generation_config_to_hf(cfg)

    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    fresh = not root.exists()
    if fresh:
        root.parent.mkdir(parents=True, exist_ok=True)
    staging = (root.parent if fresh else root) / f".{root.name}.saving-{uuid.uuid4().hex[:12]}"
    staging.mkdir()  # (not mkdtemp: its 0700 mode would become the saved directory's)
    try:
        for name, shard in zip(names, shards):
            write_safetensors(staging / name, shard)
        if index is not None:
            write_json(staging / INDEX, index)
        write_json(staging / GENERATION, generation)
        write_json(staging / CONFIG, hf_config)
        _fsync_dir(staging)
        if fresh:
            os.rename(staging, root)
            _fsync_dir(root.parent)
            return
        # Existing directory: invalidate it first (no config.json), replace the weights, drop
        # stale ones from an earlier save, and only then put config.json back.
        (root / CONFIG).unlink(missing_ok=True)
        _fsync_dir(root)
        for p in root.iterdir():
            if (
                p.is_file()
                and (p.name in (WEIGHTS, INDEX) or _SHARD.match(p.name))
                and p.name not in names
            ):
                p.unlink()
        for p in sorted(staging.iterdir(), key=lambda p: p.name == CONFIG):
            os.replace(p, root / p.name)
        _fsync_dir(root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
