"""The FLOP floor of a GRPO step: the arithmetic its real tokens need, at a measured matmul peak.

A step of ``P`` prompts (mean ``Lp`` real tokens, each run once for its ``G`` completions: the
prefix is shared everywhere in relax) and ``P G`` completions (mean ``Lc`` real tokens) needs, for
a dense decoder of ``L`` layers, width ``h``, ``Hq`` query heads of ``D``, vocabulary ``V``::

    M_layers = the entries of the layers' matrices     (ModelConfig.stacked_shapes: q, k, v, o,
                                                         gate, up, down; norms and biases apart)
    linear(n, with_head) = 2 n (M_layers + [with_head] V h)      (a forward over n tokens)
    attention = 4 L Hq D (P Lp^2 / 2 + P G (Lc Lp + Lc^2 / 2))  (QK^T and PV over the causal
                                                                  context, prompt once)
    forward = linear(P Lp, head=False) + linear(P G Lc, head=True) + attention

(the head only where a token is scored: at the completions; the input embedding is a lookup).
Sampling is one forward, the reference one more when ``beta > 0``, and the update ``3 x`` a
forward (forward and backward) per pass over the batch (``num_iterations``)::

    floor_s = (1 + [beta > 0] + 3 num_iterations) forward / peak

A floor, not an estimate: no recomputation (remat), no optimizer, no padding, no sampler
overheads; the attention's ``Lc^2`` uses the mean length (real lengths spread it higher).
"""

from __future__ import annotations

import math
from pathlib import Path


def forward_flops(config, prompts: int, generations: int, prompt_len: float, completion_len: float):
    """FLOPs of one forward over a step's real tokens (module docstring); ``config`` a relax
    ``ModelConfig`` of a dense decoder."""
    if config.num_experts:
        raise ValueError("flop_floor: a mixture of experts needs its active parameters counted")
    matrices = [s for s in config.stacked_shapes().values() if len(s) == 3]  # [layers, in, out]
    layers = sum(math.prod(s) for s in matrices)
    head = config.vocab_size * config.hidden_size
    hq, d = config.num_heads, config.head_dim
    p_tokens, c_tokens = prompts * prompt_len, prompts * generations * completion_len
    linear = 2 * p_tokens * layers + 2 * c_tokens * (layers + head)
    context = prompts * prompt_len**2 / 2 + prompts * generations * (
        completion_len * prompt_len + completion_len**2 / 2
    )
    return linear + 4 * config.num_layers * hq * d * context


def step_floor(
    config,
    *,
    prompts: int,
    generations: int,
    prompt_len: float,
    completion_len: float,
    beta: float,
    num_iterations: int,
    peak_flops: float,
) -> dict:
    """The floor of one step of a ``ModelConfig``'s model in FLOPs and seconds at ``peak_flops``
    (module docstring)."""
    fwd = forward_flops(config, prompts, generations, prompt_len, completion_len)
    passes = 1 + (beta > 0) + 3 * num_iterations
    flops = passes * fwd
    return {
        "forward_tflop": fwd / 1e12,
        "step_tflop": flops / 1e12,
        "peak_gflops": peak_flops / 1e9,
        "floor_s": flops / peak_flops,
    }


def mean_prompt_tokens(model_dir: str | Path, prompts: list[str]) -> float:
    """Mean real tokens of ``prompts`` rendered through the model's chat template (a user turn,
    generation prompt added), as the trainer renders a plain-string prompt."""
    from relax.text.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    lengths = [
        len(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in prompts
    ]
    return sum(lengths) / len(lengths)


def steps_at_floor(
    model_dir, h: dict, prompt_len: float, curve: list[dict], peak: float
) -> list[dict]:
    """Per logged step of a relax run (``curve``: ``completion_length``, ``time/step``): its floor
    and ``of_peak`` = floor / step, the share of the matmul peak the whole step ran at."""
    from relax.models.hf.checkpoint import read_config

    config, out = read_config(model_dir), []
    for r in curve:
        if "time/step" not in r or r.get("completion_length") is None:
            continue
        f = step_floor(
            config,
            prompts=h["prompts_per_step"],
            generations=h["num_generations"],
            prompt_len=prompt_len,
            completion_len=r["completion_length"],
            beta=h["beta"],
            num_iterations=h["num_iterations"],
            peak_flops=peak,
        )
        out.append(
            {
                "step": r.get("step"),
                "step_s": r["time/step"],
                **f,
                "of_peak": f["floor_s"] / r["time/step"],
            }
        )
    return out
