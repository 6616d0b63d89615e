"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

    save_adapter(policy, "out/adapter", base_model_name_or_path="Qwen/Qwen3-0.6B")
    policy = load_adapter(base, "out/adapter")      # base + the adapters, ready to train or sample

Tensor names are the ones ``peft`` writes for a causal LM (the adapter name dropped):
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``, i.e. relax's ``a[j].T`` and ``b[j].T``, ``j`` the place of
layer ``i`` among those the weight is on (``ModelConfig.layer_indices``: a dense layer's
``mlp.gate_proj``, a sparse layer's ``mlp.shared_expert.gate_proj``); the module path is the
family record's (``relax.models.config.families``). The language model of a vision-language
model sits elsewhere in transformers' class: ``prefix`` (its ``VisionFamily.peft_prefix``,
``model.language_model`` for Gemma 3 and Qwen2.5-VL) gives
``base_model.model.model.language_model.layers.{i}...``, and the config's ``exclude_modules``
(a regex of every module outside that path) keeps PEFT off the vision tower's modules of the
same names (Qwen2.5-VL's ``mlp.gate_proj``, SigLIP's ``self_attn.q_proj``).

Adapters on a module the checkpoint fuses (Phi-3's ``qkv_proj``, ``gate_up_proj``) have no PEFT
form and are refused both ways (``fused_adapter_error``); Phi-3's other modules save and load as
usual. The config holds what
``peft.LoraConfig`` reads (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``use_rslora``, ``init_lora_weights``, ``bias``...). Adapters with features relax does not
run (DoRA, per-module rank or alpha patterns, extra trained modules, biases, a subset of layers)
are refused with an ``HFFormatError`` naming the file and field, never half-loaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from relax.models.adapters.operations import with_adapters
from relax.models.adapters.tower import ModuleLoRA
from relax.models.config.families import get_family
from relax.models.decoder.transformer import Transformer
from relax.models.hf.config import HFFormatError
from relax.models.hf.weights_io import SafetensorsFile, read_json, write_json, write_safetensors
from relax.models.layers.lora import TARGETS, Adapters, LoRAConfig, LoRAWeights

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_UNSUPPORTED = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "layer_replication": (None, []),
}


TEXT_PREFIX = "model"  # a causal LM's decoder in transformers' class: model.layers.{i}


def _name(i: int, module: str, factor: str, prefix: str = TEXT_PREFIX) -> str:
    """PEFT's name of layer ``i``'s ``lora_{factor}`` on ``module`` (its path under the layer),
    the layers under ``prefix`` (the language model's module path)."""
    return f"base_model.model.{prefix}.layers.{i}.{module}.lora_{factor}.weight"


def exclude_outside(prefix: str) -> str:
    r"""PEFT's ``exclude_modules`` regex (full match on a module's path) for every module not
    under ``prefix``: ``(?!model\.language_model\.).*`` for ``model.language_model``."""
    return rf"(?!{re.escape(prefix)}\.).*"


def fused_adapter_error(family: str, fields) -> str | None:
    """Why adapters on ``fields`` of a ``family`` model have no PEFT form (None: they have one).

    A family whose checkpoint fuses weights (Phi-3: q/k/v in ``qkv_proj``, gate/up in
    ``gate_up_proj``) is adapted by PEFT with one ``lora_A`` shared by the fused parts; relax
    adapts each part with its own ``A``, which that format cannot hold (and a shared-A adapter
    would not stay shared once relax trains it).
    """
    rec = get_family(family)
    fused = {f: m for m, fs in rec.fused_lora_modules.items() for f in fs}
    hit = [m for m in rec.fused_lora_modules if any(fused.get(f) == m for f in fields)]
    if not hit:
        return None
    free = sorted({m.rsplit(".", 1)[-1] for f, m in rec.lora_modules.items() if f not in fused})
    parts = {
        m: [next(k for k, fs in TARGETS.items() if f in fs) for f in rec.fused_lora_modules[m]]
        for m in hit
    }
    return (
        f"{family} stores {', '.join(f'{parts[m]} as one {m}' for m in hit)}: PEFT adapts such a fused "
        f"module with one lora_A shared by its parts, while relax's adapters give each part its own, so "
        f"they have no PEFT form. Export the merged model (merge_lora + save_pretrained), or adapt only "
        f"the unfused modules {free}"
    )


def save_adapter(
    model: Transformer,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    prefix: str = TEXT_PREFIX,
    tower: ModuleLoRA | None = None,
    tower_modules: dict[str, str] | None = None,
) -> Path:
    """Write the model's adapters to ``path`` in PEFT's format (``peft.PeftModel.from_pretrained``
    loads them onto the base).

    Args:
        model: a ``Transformer`` with LoRA adapters, none on a module its checkpoint fuses
            (``fused_adapter_error``).
        path: the directory to write ``adapter_config.json`` and ``adapter_model.safetensors``
            into; created with its parents when absent.
        base_model_name_or_path: written to the config's ``base_model_name_or_path``, for PEFT
            to find the base model. None (default): none.
        prefix: the language model's module path in the transformers class the adapter is for:
            ``"model"`` (default: a causal LM), or a vision-language family's ``peft_prefix``
            (``relax.models.vision.families``; the config then excludes every other module).
        tower: a vision tower's adapters (``--lora.vision``), written beside the language
            model's under ``tower_modules`` (its family's ``lora_modules``: each adapted weight's
            module in transformers' class, ``{i}`` its layer); the config's ``target_modules``
            then lists every adapted module's full path.

    Returns:
        The directory written, as a ``Path``.
    """
    ad = model.layers.lora
    if ad is None:
        raise ValueError("the model has no LoRA adapters to save")
    weights = ad.weights()
    why = fused_adapter_error(model.config.family, weights)
    if why is not None:
        raise ValueError(why)
    modules = get_family(model.config.family).lora_modules
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = []
    for field, w in weights.items():
        for factor, arr in (
            ("A", np.asarray(w.a)),
            ("B", np.asarray(w.b)),
        ):  # to host once, [L, ...]
            for j, i in enumerate(model.config.layer_indices(field)):
                make = lambda arr=arr, j=j: arr[j].T  # noqa: E731
                name = _name(i, modules[field], factor, prefix)
                tensors.append((name, arr.shape[1:][::-1], arr.dtype, make))
    targets = sorted({modules[f].rsplit(".", 1)[-1] for f in weights})
    exclude = None if prefix == TEXT_PREFIX else exclude_outside(prefix)
    if tower is not None:  # every module by its full path: the tower's names repeat the LM's
        tensors += _tower_tensors(tower, tower_modules)
        targets = sorted(
            {
                f"{prefix}.layers.{i}.{modules[f]}"
                for f in weights
                for i in model.config.layer_indices(f)
            }
            | {t.split(".lora_")[0].removeprefix("base_model.model.") for t, *_ in tensors}
        )
        exclude = None
    write_safetensors(root / WEIGHTS, tensors)
    write_json(
        root / CONFIG,
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": ad.rank,
            "lora_alpha": ad.alpha,
            "lora_dropout": ad.dropout,
            "target_modules": targets,
            "exclude_modules": exclude,
            "bias": "none",
            "use_rslora": ad.use_rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "base_model_name_or_path": base_model_name_or_path,
            "revision": None,
        },
    )
    return root


def _tower_tensors(tower: ModuleLoRA, modules: dict[str, str]) -> list:
    """The tower's ``lora_A`` / ``lora_B`` tensors (``[r, in]`` / ``[out, r]`` per layer) under
    PEFT's names: ``base_model.model.{module}.lora_{A,B}.weight``."""
    out = []
    for p in sorted(tower.a):
        template = modules[p]
        for factor, arr in (("A", np.asarray(tower.a[p])), ("B", np.asarray(tower.b[p]))):
            stacked = "{i}" in template
            for i in range(arr.shape[0]) if stacked else (None,):
                one = arr[i] if stacked else arr
                name = f"base_model.model.{template.format(i=i)}.lora_{factor}.weight"
                out.append((name, one.shape[::-1], one.dtype, lambda one=one: one.T))
    return out


def read_adapter_config(path: str | os.PathLike, prefix: str = TEXT_PREFIX) -> LoRAConfig:
    """The ``LoRAConfig`` of a PEFT adapter directory (checked: relax runs everything it says);
    ``target_modules`` given as full module paths (relax's with a tower's adapters) name the
    language model's under ``prefix``."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise HFFormatError(
            f"{file}: no such file (a PEFT adapter directory has {CONFIG} and {WEIGHTS})"
        )
    c = read_json(file)
    if c.get("peft_type", "LORA") != "LORA":
        raise HFFormatError(f"{file}: peft_type {c['peft_type']!r} is not LORA")
    for field, allowed in _UNSUPPORTED.items():
        if field in c and c[field] not in allowed:
            raise HFFormatError(
                f"{file}: {field}={c[field]!r} is not supported (relax runs plain LoRA)"
            )
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in c:
            raise HFFormatError(f"{file}: field {field!r} is missing")
    targets = c["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if any("." in t for t in targets):  # full module paths (relax's with a tower's adapters)
        lm = [t for t in targets if t.startswith(f"{prefix}.layers.")]
        targets = sorted({t.rsplit(".", 1)[-1] for t in lm})
    try:
        return LoRAConfig(
            rank=int(c["r"]),
            alpha=float(c["lora_alpha"]),
            dropout=float(c.get("lora_dropout", 0.0)),
            target_modules=tuple(targets),
            use_rslora=bool(c.get("use_rslora", False)),
        )
    except ValueError as e:
        raise HFFormatError(f"{file}: {e}") from None


def _stacked_factor(
    st: SafetensorsFile,
    names: dict[str, str],
    module: str,
    factor: str,
    want: tuple[int, int],
    layers_of: tuple[int, ...],
    prefix: str,
) -> np.ndarray:
    """``lora_{factor}`` of ``module`` on the layers ``layers_of``, transposed to relax's layout and stacked."""
    layers = []
    for i in layers_of:
        name = _name(i, module, factor, prefix)
        if name not in names:
            raise HFFormatError(
                f"{st.path}: tensor {name!r} is missing{_prefix_hint(names, prefix)}"
            )
        arr = st.read(names[name])
        if arr.shape != want:
            raise HFFormatError(
                f"{st.path}: tensor {name!r} has shape {list(arr.shape)}, "
                f"the base model needs {list(want)}"
            )
        layers.append(np.array(arr.T))
    return np.stack(layers)


def _prefix_hint(names, prefix: str) -> str:
    """Where the file's layers are, when not under ``prefix`` (an adapter for another class)."""
    found = sorted(
        {
            m.group(1)
            for n in names
            if (m := re.match(r"base_model\.model\.(.+?)\.layers\.\d+\.", n))
        }
    )
    if not found or prefix in found:
        return ""
    return (
        f" (its layers are under {found}, not {prefix!r}: pass prefix=, e.g. a vision-language "
        "family's peft_prefix)"
    )


def _check_unfused_targets(family: str, file: Path) -> None:
    """Refuse an adapter on a fused module of ``family`` (``fused_adapter_error``) by its name,
    before its target names are read as relax's."""
    if not file.is_file():
        return  # read_adapter_config names the missing file
    c = read_json(file)
    targets = c.get("target_modules") if isinstance(c, dict) else None
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    rec = get_family(family)
    fused = [m for m in rec.fused_lora_modules if m.rsplit(".", 1)[-1] in targets]
    if fused:
        raise HFFormatError(
            f"{file}: {fused_adapter_error(family, rec.fused_lora_modules[fused[0]])}"
        )


def load_adapter(
    base: Transformer, path: str | os.PathLike, *, dtype=None, prefix: str = TEXT_PREFIX
) -> Transformer:
    """``base`` with the PEFT adapter at ``path`` (``dtype``: the adapters' dtype; default as
    stored).

    Args:
        base: the ``Transformer`` the adapter was trained on (the same shapes).
        path: a PEFT adapter directory: ``adapter_config.json`` and
            ``adapter_model.safetensors``.
        dtype: the adapters' dtype. None (default): as stored.
        prefix: the language model's module path in the adapter's transformers class:
            ``"model"`` (default: a causal LM), or a vision-language family's ``peft_prefix``
            (``base`` is then that model's language model; adapters on its vision tower are
            refused as tensors relax does not adapt).

    Returns:
        ``base`` with the adapters in ``layers.lora`` (every base array shared), ready to train or
            sample. A config relax does not run, or a missing, misshapen or extra tensor, raises
            ``HFFormatError``.
    """
    _check_unfused_targets(base.config.family, Path(path) / CONFIG)
    cfg = read_adapter_config(path, prefix)
    why = fused_adapter_error(base.config.family, cfg.fields())
    if why is not None:
        raise HFFormatError(f"{Path(path) / CONFIG}: {why}")
    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise HFFormatError(f"{file}: no such file")
    st = SafetensorsFile(file)
    names = {
        n.replace(".default.weight", ".weight"): n for n in st.entries
    }  # PEFT's adapter-name infix
    c, shapes = base.config, base.config.layer_shapes()
    modules = get_family(c.family).lora_modules
    cast = jnp.asarray if dtype is None else (lambda x: jnp.asarray(x, dtype))
    weights = {}
    for field in cfg.fields():
        if (
            field not in shapes
        ):  # gate_proj on a model without a dense MLP or without a shared expert
            continue
        module, (fan_in, fan_out), at = modules[field], shapes[field], c.layer_indices(field)
        a = _stacked_factor(st, names, module, "A", (cfg.rank, fan_in), at, prefix)
        b = _stacked_factor(st, names, module, "B", (fan_out, cfg.rank), at, prefix)
        weights[field] = LoRAWeights(cast(a), cast(b))
    if not weights:
        raise HFFormatError(
            f"{Path(path) / CONFIG}: target_modules {list(cfg.target_modules)} name no linear layer "
            f"of this {c.family} model"
        )
    used = {
        names[_name(i, modules[f], x, prefix)]
        for f in weights
        for i in c.layer_indices(f)
        for x in "AB"
    }
    extra = sorted(set(st.entries) - used)
    if extra:
        outside = prefix != TEXT_PREFIX and not any(f"{prefix}.layers." in n for n in extra)
        why = (
            " (outside the language model: a vision tower's adapters, which load_adapter does "
            "not read; a run's final_hf holds them merged)"
            if outside
            else ""
        )
        raise HFFormatError(f"{file}: tensors for modules relax does not adapt{why}: {extra[:5]}")
    ad = Adapters(**weights, alpha=cfg.alpha, use_rslora=cfg.use_rslora, dropout=cfg.dropout)
    return with_adapters(base, ad)
