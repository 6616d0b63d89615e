"""The policy of a relax run, for ``relax eval --run-dir RUN [--step N]``.

- ``--step N``: the run's checkpoint of step N (``RUN/checkpoints/N``), else its export
  ``RUN/hf/step-N``;
- no step: ``RUN/final_hf`` (the end of the run), else the newest of its periodic exports
  (``hf/step-N``) and its checkpoints, the export when both hold that step.

A checkpoint is read as the run would resume it, without writing to its directory (the run may
still be saving there): only the policy, verified against the step's integrity record. Its base
is the run's own, from the config saved with the step: ``--model`` (or the built-in task's
``RUN/base_model``) in the run's ``--param-dtype``, with ``--lora`` adapters put on it when the
run trained adapters (their base weights checked bit for bit). The policy is evaluated in float32.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from relax.eval.harness.load import (
    Policy,
    export_steps,
    language_model,
    load_policy,
    run_export,
)
from relax.eval.harness.run import HarnessConfig
from relax.models.adapters.operations import add_lora
from relax.models.decoder.transformer import cast
from relax.models.layers.lora import LoRAConfig
from relax.text.loader import load_tokenizer
from relax.train.checkpoint import CheckpointCorruptError, Checkpointer
from relax.train.run_dir import CHECKPOINTS


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The committed checkpoint steps of a run (``RUN/checkpoints/<step>``), ascending."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    with Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.all_steps()


def load_run_policy(cfg: HarnessConfig) -> Policy:
    """``relax eval``'s checkpoint: ``--run-dir`` (+ ``--step``) by ``run_policy``, else
    ``--model`` (+ ``--adapter``)."""
    if cfg.run_dir is None or cfg.adapter is not None:
        return load_policy(cfg.model, cfg.adapter, cfg.run_dir)  # its errors for bad pairs
    if cfg.model is not None:
        raise ValueError("give exactly one of --model and --run-dir")
    return run_policy(cfg.run_dir, cfg.step)


def run_policy(run_dir: str | Path, step: int | None = None) -> Policy:
    """The policy of run ``run_dir`` at ``step`` (the module's rules); an error names the run
    and the steps it has when there is no such step."""
    run = Path(run_dir)
    checkpoints, exports = checkpoint_steps(run), export_steps(run)
    if step is None:
        if not (checkpoints or exports or (run / "final_hf").is_dir()):
            raise FileNotFoundError(
                f"{run}: no export (final_hf/, hf/step-N/) and no checkpoint (checkpoints/N/); "
                f"a run exports at its end (--export-hf) and saves every --checkpoint-every steps"
            )
        if (run / "final_hf" / "config.json").is_file() or not checkpoints:
            return load_policy(run_dir=str(run))
        if exports and max(exports) >= max(checkpoints):
            return load_policy(model=str(run_export(run)))
        return checkpoint_policy(run, max(checkpoints))
    if step in checkpoints:
        return checkpoint_policy(run, step)
    if step in exports:
        return load_policy(model=str(run / "hf" / f"step-{step}"))
    raise FileNotFoundError(
        f"{run}: no checkpoint or export of step {step}; checkpoints {checkpoints}, "
        f"exports (hf/step-N) {exports}"
    )


def checkpoint_policy(run_dir: str | Path, step: int) -> Policy:
    """The policy of ``RUN/checkpoints/<step>`` on the run's base, float32."""
    run = Path(run_dir)
    with Checkpointer(run / CHECKPOINTS, read_only=True) as ckpt:
        config = ckpt.config(step)
        base = base_of(run, config)
        try:
            policy, _ = ckpt.restore_policy(step, target=run_model(base, config))
        except CheckpointCorruptError:
            raise
        except ValueError as e:  # another model than a language model of that base
            raise ValueError(
                f"{run} step {step}: its policy is not a language model of {base} as relax eval "
                f"evaluates one (a reward model's run?): {e}"
            ) from e
    tokenizer = config.get("tokenizer") or base
    source = f"{run} checkpoint step {step} (base {base})"
    return Policy(cast(policy, param_dtype=jnp.float32), load_tokenizer(tokenizer), source)


def base_of(run: Path, config: dict) -> Path:
    """The run's base model directory: its ``model``, or the built-in task's ``base_model``."""
    base = Path(config["model"]) if config.get("model") else run / "base_model"
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{run}: the run's base model {base} (its config's 'model') has no config.json; "
            f"its checkpoints hold {'adapters' if lora_of(config) else 'weights'} for that model"
        )
    return base


def lora_of(config: dict) -> LoRAConfig | None:
    """The run's ``--lora`` settings when it trained adapters, else None."""
    lora = config.get("lora") or {}
    if not lora.get("rank"):
        return None
    return LoRAConfig(**{**lora, "target_modules": tuple(lora["target_modules"])})


def run_model(base: Path, config: dict):
    """The policy's structure as the run built it: ``base`` (the language model of a vision-
    language base) in the run's ``param_dtype``, with fresh adapters when it trained LoRA."""
    model = language_model(base, param_dtype=jnp.dtype(config.get("param_dtype") or "float32"))
    lora = lora_of(config)
    return model if lora is None else add_lora(model, lora, jax.random.key(0))
