"""Peak memory of the rollout and of the update under each memory option.

Cases (one subprocess per case x phase, so every measurement has its own high-water mark):

    f32          float32 params, no remat (the reference point)
    remat        GRPOConfig.forward.remat: each layer recomputed in the backward pass
    bf16         bfloat16 params (and compute), no master weights
    bf16_master  bfloat16 params + float32 master weights in the optimizer state
    offload_ref  KL reference in pinned host memory between uses (GPU/TPU; on CPU a no-op)
    lora         float32 base + rank-``lora_rank`` adapters on every linear layer (the reference is
                 the base: no copy); ``opt_state_mb`` shows the optimizer state of the adapters only
    many_vmap    K = ``adapters`` LoRA adapters on one base, one update of all of them (jax.vmap;
                 an SFT loss on a ``prompts x (prompt_len + new_tokens)`` token batch); phase update only
    many_seq     the same K adapters updated one after the other (one compiled update, K calls)

Phases: ``rollout`` (the sampler segment) and ``update`` (the reference segment, then the
advantage + update segment, on a synthetic batch of the rollout's shapes). Each phase runs twice through
``relax.parallel.ShardedStep`` on a mesh of all local devices (``fsdp=-1``); the second run is
measured, so compilation is not counted. Memory: on CPU the resident-set high-water mark above
the resident size before the measured run (state and batch already resident); on GPU/TPU the
device allocator's ``peak_bytes_in_use`` (process-wide: includes the resident state). Every line
also carries ``state_device_bytes`` / ``state_host_bytes``: the train state's arrays by memory
kind (exact, noise-free: shows what master weights and offloading move).

    python benchmarks/memory.py                         # all cases, small_config, both phases
    python benchmarks/memory.py --cases f32,remat --phases update --hidden 1024 --layers 8 --heads 16
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from relax import parallel  # noqa: E402
from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.loss import make_grpo_update  # noqa: E402
from relax.algorithms.grpo.step import make_grpo_step  # noqa: E402
from relax.algorithms.online.batch import HostRecord, LossRows, Sampled, Scored, step_input  # noqa: E402
from relax.algorithms.online.stages import sample_versions  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.compose import WithHost  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.models.adapters.operations import add_lora, split_trainable  # noqa: E402
from relax.models.layers.lora import LoRAConfig  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.train import many  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.state import init_state  # noqa: E402
from relax.train.update import make_update  # noqa: E402

CASES = ("f32", "remat", "bf16", "bf16_master", "offload_ref", "lora", "many_vmap", "many_seq")
PHASES = ("rollout", "update")


@dataclasses.dataclass(frozen=True)
class Args:
    cases: str = ",".join(CASES)
    phases: str = ",".join(PHASES)
    prompts: int = 8
    generations: int = 8
    prompt_len: int = 64
    new_tokens: int = 128
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 4096
    lora_rank: int = 8
    adapters: int = 4
    """K, for the many_* cases"""
    child: str = ""
    """internal: ``case:phase`` measured in this process"""
    timeout_s: float = 600.0


def _reward(prompts, completions, **fields):
    return [float(len(c) % 2) for c in completions]


def _decode(tokens, mask):
    return [" ".join(map(str, row[m > 0])) for row, m in zip(tokens, mask)]


def _state_bytes(state) -> tuple[int, int]:
    dev = host = 0
    for x in jax.tree.leaves(state):
        n = x.nbytes if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else 8
        if getattr(x.sharding, "memory_kind", "device") in ("pinned_host", "unpinned_host"):
            host += n
        else:
            dev += n
    return dev, host


def _synthetic_rollout(args: Args, vocab: int, ids, mask) -> WithHost:
    p, g, n = args.prompts, args.generations, args.new_tokens
    k = jax.random.split(jax.random.key(7), 2)
    tokens = jax.random.randint(k[0], (p, g, n), 0, vocab)
    scored = Scored(
        prompt_ids=ids,
        prompt_mask=mask,
        tokens=tokens,
        mask=jnp.ones((p, g, n), jnp.int32),
        old_logprobs=-2.0 + 0.1 * jax.random.normal(k[1], (p, g, n)),
        lengths=jnp.full((p, g), n, jnp.int32),
        finished=jnp.ones((p, g), bool),
        policy_version=jnp.zeros((p, g), jnp.int32),  # set to the state's step by _run
        rewards=jax.random.normal(k[0], (p, g)),
        reward_parts={},
    )
    return WithHost(
        scored, HostRecord(prompts=["x"] * p, fields={}, reward_info={"errors": 0, "timeouts": 0})
    )


def _model_config(args: Args):
    return small_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=int(args.hidden * 2.6875) // 8 * 8,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
    )


def _bytes(tree) -> int:
    return sum(_state_bytes(tree))


def _xla_mb(jitted, *args) -> dict:
    """XLA's buffer assignment for ``jitted(*args)``: arguments, outputs and temporaries (MB),
    deterministic where the RSS high-water mark is noisy."""
    m = jitted.lower(*args).compile().memory_analysis()
    mb = lambda b: int(b) / 2**20  # noqa: E731
    return {
        "xla_args_mb": mb(m.argument_size_in_bytes),
        "xla_out_mb": mb(m.output_size_in_bytes),
        "xla_temp_mb": mb(m.temp_size_in_bytes),
        "xla_total_mb": mb(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        ),
    }


def _grpo_update_xla(cfg, opt, model, batch: WithHost, passes) -> dict:
    """``_xla_mb`` of the GRPO update alone (``make_grpo_update``) on the synthetic rollout."""
    b = batch.device
    data = LossRows(
        prompt_ids=b.prompt_ids,
        prompt_mask=b.prompt_mask,
        tokens=b.tokens,
        mask=b.mask,
        old_logprobs=b.old_logprobs,
        loss_mask=b.mask,
        ref_logprobs=b.old_logprobs,
        advantages=b.rewards,
    )
    update = jax.jit(make_grpo_update(cfg, opt, passes))
    return _xla_mb(update, model, opt.init(split_trainable(model)[0]), data, jax.random.key(0))


def _peak(fn) -> tuple[float, int | None, str]:
    """``(seconds, peak bytes, how)`` of one call of ``fn`` after a compiling call."""
    jax.block_until_ready(fn())
    reset = harness.on_cpu() and harness._reset_hwm()
    base = harness._rss_bytes() if reset else harness._hwm_bytes()
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    run_s = time.perf_counter() - t0
    if harness.on_cpu():
        return (
            run_s,
            max(harness._hwm_bytes() - base, 0),
            "rss high-water above the rss before the run",
        )
    return (
        run_s,
        harness._device_peak(),
        "device peak_bytes_in_use (process-wide, includes the state)",
    )


def many_child(args: Args, case: str) -> dict:
    """K adapters updated at once (vmap) or one after the other, on one SFT batch."""
    mcfg, k = _model_config(args), args.adapters
    base = init(mcfg, jax.random.key(0))
    lora = LoRAConfig(rank=args.lora_rank)
    models = [add_lora(base, lora, jax.random.key(i)) for i in range(k)]
    opt = many.with_learning_rate_scale(OptimizerConfig(learning_rate=1e-4).make())
    t = args.prompt_len + args.new_tokens
    ids = jax.random.randint(jax.random.key(2), (args.prompts, t), 0, mcfg.vocab_size)
    batch = {"ids": ids, "loss_mask": jnp.ones_like(ids)}

    def loss_fn(model, mb, ctx):
        logp = jax.nn.log_softmax(model(mb["ids"][:, :-1]))
        nll = -jnp.take_along_axis(logp, mb["ids"][:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mb["loss_mask"][:, 1:]) / ctx.norms["tokens"], {}

    update = make_update(loss_fn, opt)
    keys = jax.random.split(jax.random.key(3), k)
    if case == "many_vmap":
        stacked = many.stack_adapters(models)
        states = many.init_many(opt, stacked, [1.0] * k)
        step = jax.jit(many.vmap_over_adapters(update, stacked))
        fn = lambda: step(stacked, states, batch, keys)  # noqa: E731
        opt_bytes, xla = _bytes(states), _xla_mb(step, stacked, states, batch, keys)
    else:
        step = jax.jit(update)
        states = [opt.init(split_trainable(m)[0]) for m in models]
        fn = lambda: [step(m, s, batch, key) for m, s, key in zip(models, states, keys)]  # noqa: E731
        opt_bytes, xla = _bytes(states), _xla_mb(step, models[0], states[0], batch, keys[0])
        xla["xla_note"] = "one of the K calls (they run one at a time)"
    run_s, peak, how = _peak(fn)
    return {
        "bench": "memory",
        "case": case,
        "phase": "update",
        "K": k,
        "rank": args.lora_rank,
        "peak_mem_mb": peak / 2**20 if peak else None,
        "peak_mem_how": how,
        "run_s": run_s,
        "opt_state_mb": opt_bytes / 2**20,
        "params_m": mcfg.num_params() / 1e6,
        "rows": args.prompts,
        "T": t,
        **xla,
    }


def _segments(step, names: tuple[str, ...]) -> list:
    """The step's segments called ``names`` (a fused segment's name joins its stages with "+"), in
    that order; a ``KeyError`` lists the segments there are."""
    segs = {"+".join(s.names): s for s in step.segments}
    missing = [n for n in names if n not in segs]
    if missing:
        raise KeyError(f"segments {missing} not in the GRPO step's {list(segs)}")
    return [segs[n] for n in names]


def _run(segs: list, state, batch: WithHost):
    """Run ``segs`` one after the other on ``batch``: ``(state, batch)``."""
    if isinstance(
        batch.device, Sampled
    ):  # the synthetic rollout: drawn by the state's own policy, as a real one
        batch = batch.replace(
            device=batch.device.replace(
                policy_version=sample_versions(state, batch.device.policy_version)
            )
        )
    for seg in segs:
        state, batch = seg.run(state, batch)
    return state, batch


def child(args: Args, case: str, phase: str) -> dict:
    if case.startswith("many_"):
        return many_child(args, case)
    dtype = jnp.bfloat16 if case.startswith("bf16") else jnp.float32
    mcfg = _model_config(args)
    model = init(mcfg, jax.random.key(0), param_dtype=dtype, dtype=dtype)
    if case == "lora":
        model = add_lora(model, LoRAConfig(rank=args.lora_rank), jax.random.key(5))
    cfg = preset(
        "grpo",
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        beta=0.04,
        remat=case == "remat",
        optimizer=OptimizerConfig(learning_rate=1e-6, master_weights=case == "bf16_master"),
    )
    opt = cfg.optimizer.make()
    state = init_state(model, opt, key=jax.random.key(1), with_reference=True)
    mesh = parallel.make_mesh("fsdp=-1", jax.local_devices())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passes = choose_passes(batch_shards=parallel.batch_shards(mesh))
        step = parallel.ShardedStep(
            make_grpo_step(
                cfg,
                StepParts(
                    reward_fns=[_reward], decode=_decode, eos_ids=(), pad_id=0, passes=passes
                ),
            ),
            state,
            mesh,
            offload_reference=case == "offload_ref",
        )
    state = step.place(state)
    ids = jax.random.randint(jax.random.key(2), (args.prompts, args.prompt_len), 0, mcfg.vocab_size)
    mask = jnp.ones_like(ids)
    if phase == "rollout":
        segs = _segments(step, ("rollout",))
        batch = step_input(ids, mask, ["x"] * args.prompts, {})
    else:
        segs = _segments(step, ("reference", "advantage+update"))
        batch = _synthetic_rollout(args, mcfg.vocab_size, ids, mask)
        xla = _grpo_update_xla(cfg, opt, model, batch, passes)
    t0 = time.perf_counter()
    state, out = _run(segs, state, batch)  # compiles
    jax.block_until_ready((state, out.device))
    first_s = time.perf_counter() - t0
    dev_bytes, host_bytes = _state_bytes(state)
    reset = harness.on_cpu() and harness._reset_hwm()
    base = harness._rss_bytes() if reset else harness._hwm_bytes()
    t0 = time.perf_counter()
    state, out = _run(segs, state, batch)
    jax.block_until_ready((state, out.device))
    run_s = time.perf_counter() - t0
    if harness.on_cpu():
        peak, how = (
            max(harness._hwm_bytes() - base, 0),
            (
                "rss high-water above the rss before the run"
                if reset
                else "ru_maxrss delta (includes compile)"
            ),
        )
    else:
        peak, how = (
            harness._device_peak(),
            "device peak_bytes_in_use (process-wide, includes the state)",
        )
    note = "; ".join(str(w.message) for w in caught) or None
    return {
        "bench": "memory",
        "case": case,
        "phase": phase,
        "peak_mem_mb": peak / 2**20 if peak else None,
        "peak_mem_how": how,
        "state_device_mb": dev_bytes / 2**20,
        "state_host_mb": host_bytes / 2**20,
        "run_s": run_s,
        "first_call_s": first_s,
        "params_m": mcfg.num_params() / 1e6,
        "opt_state_mb": _bytes(state.opt_state) / 2**20,
        **(xla if phase == "update" else {}),
        "P": args.prompts,
        "G": args.generations,
        "Lp": args.prompt_len,
        "N": args.new_tokens,
        "offloaded": bool(step.offload),
        "note": note,
    }


def main(args: Args) -> None:
    if args.child:
        case, phase = args.child.split(":")
        harness.emit(child(args, case, phase))
        return
    table = [
        "case",
        "phase",
        "peak_mem_mb",
        "xla_temp_mb",
        "xla_total_mb",
        "state_device_mb",
        "opt_state_mb",
        "run_s",
    ]
    argv = [a for a in sys.argv[1:] if not a.startswith("--child")]
    for case in filter(None, args.cases.split(",")):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; valid: {', '.join(CASES)}")
        for phase in filter(None, args.phases.split(",")):
            if case.startswith("many_") and phase != "update":
                continue
            harness.run_isolated(
                os.path.abspath(__file__),
                [*argv, "--child", f"{case}:{phase}"],
                timeout=args.timeout_s,
                table=table,
            )


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main(tyro.cli(Args))
