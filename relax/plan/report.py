"""A plan as the table ``relax plan`` prints: per program and per chip, what takes the memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax.plan.plan import Plan

COLUMNS = (
    "weights",
    "optimizer",
    "reference",
    "critic",
    "batch",
    "kv_cache",
    "activations",
    "outputs",
)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


NOTES = {
    "distill": "reference: the teacher (--teacher), never updated",
    "agent": "start, fused_layers, decode_turn, append: the multi-turn decoder on the policy "
    "(weights: with its fused decode weights); the update's programs train on trajectories "
    "filling the budget (relax.plan.agent)",
}


def _layout(run) -> str:
    parallel = run.parallel
    return f"mesh {parallel.mesh}" + (
        f", sampler {parallel.sampler_devices} chips ({parallel.sampler_mesh})"
        if parallel.sampler_devices
        else ""
    )


def _columns(p: Plan) -> tuple[str, ...]:
    """The table's columns: ``sampler_weights`` after ``kv_cache`` when a program samples (its weight
    copy, ``relax.plan.memory.sampler_weights_per_chip``), ``reward_model`` too when the run has
    one (``--reward-model``), ``vision`` when its prompts hold images (the frozen vision part,
    ``relax.plan.vision``)."""
    cut = COLUMNS.index("activations")
    copy = ("sampler_weights",) if any(m.sampler_weights for m in p.programs) else ()
    reward = ("reward_model",) if any(m.reward_model for m in p.programs) else ()
    vision = ("vision",) if any(m.vision for m in p.programs) else ()
    return COLUMNS[:cut] + copy + COLUMNS[cut:] + reward + vision


def _sampler_precision(p: Plan) -> str:
    """``; sampler int8`` when the run's sampler is 8-bit (``--grpo.sampler-precision``)."""
    generation = getattr(getattr(p.run, p.algorithm, None), "generation", None)
    quantized = generation is not None and generation.quantized
    return f"; sampler {generation.sampler_precision}" if quantized else ""


def _images(p: Plan) -> str:
    """The image run's line: images per prompt, and where the encode and the vision part are."""
    i = p.images
    return (
        f"  images: {i.per_prompt} x {i.tokens} image tokens per prompt (of {p.run.max_prompt_tokens}); "
        "encode: the frozen vision tower once per image; vision: its weights, resident on the "
        "trainer's chips (relax.plan.vision)"
    )


def _width(column: str) -> int:
    return max(11, len(column) + 1)


def plan_table(p: Plan) -> str:
    """Memory per chip (GiB) of each program, the peak, whether it fits; then the traffic."""
    run, t, columns = p.run, p.target, _columns(p)
    lines = [
        f"relax plan: {p.algorithm} on {t} ({t.chips} x {t.chip.name}, {gib(t.chip.hbm_bytes)} GiB HBM per chip)",
        f"  model {p.model.family}: {p.model.num_layers} layers, width {p.model.hidden_size}, "
        f"vocab {p.model.vocab_size}; "
        + _layout(run)
        + f"; params {run.param_dtype}, compute {run.compute_dtype}"
        + _sampler_precision(p)
        + (f"; LoRA rank {run.lora.rank}" if run.lora.enabled else ""),
        f"  compiled {len(p.programs)} programs in {p.compile_s:.0f} s",
        *([f"  {NOTES[p.algorithm]}"] if p.algorithm in NOTES else []),
        *([_images(p)] if p.images is not None else []),
        "",
        "  GiB per chip      "
        + " ".join(f"{c:>{_width(c)}}" for c in columns)
        + "       total   limit  fits  compile s",
    ]
    for m in p.programs:
        cells = " ".join(f"{gib(getattr(m, c)):>{_width(c)}}" for c in columns)
        verdict = "yes" if m.fits else ("NO (compiler)" if m.error else "NO")
        mark = "~" if m.depths else " "
        lines.append(
            f"  {m.name[:15]:<15}{mark} {cells} {gib(m.total):>11} {gib(m.limit):>7}  {verdict:<4} "
            f"{m.compile_s:>6.1f}"
        )
    peak = p.peak
    lines += [
        "",
        f"  peak: {peak.name} needs {gib(peak.total)} GiB of {gib(peak.limit)} GiB per chip -> "
        + ("fits" if p.fits else "does NOT fit"),
    ]
    for m in p.programs:
        if m.depths:
            lines.append(
                f"  ~ {m.name}: extended to {p.model.num_layers} layers from compiles of its first "
                f"{' and '.join(map(str, m.depths))} (relax.plan.depth; --exact compiles it whole)"
            )
        if m.error:
            lines.append(f"  {m.name}: {m.error}")
    lines += [
        "",
        "  per chip (roofline: each kernel at peak FLOP/s or HBM bandwidth)   TFLOP    GB   est. s   collectives",
    ]
    for f in p.traffic:
        if f is None:
            continue
        coll = (
            ", ".join(f"{k} {n}x {b / 1e6:.1f} MB" for k, (n, b) in sorted(f.collectives.items()))
            or "none"
        )
        lines.append(
            f"  {f.name[:48]:<48} {f.flops / 1e12:>17.2f} {f.bytes / 1e9:>5.1f} {f.seconds:>8.3f}   {coll}"
        )
        if f.decode_step_seconds:
            per = ", ".join(
                f"{k} {n}x {b / 1e6:.2f} MB" for k, (n, b) in sorted(f.decode_collectives.items())
            )
            lines.append(
                f"    decode step: {f.decode_step_seconds * 1e3:.2f} ms, {f.decode_step_bytes / 1e9:.3f} GB; "
                f"collectives {per or 'none'}; "
                f"cache copies {f.cache_copies}"
            )
    return "\n".join(lines)
