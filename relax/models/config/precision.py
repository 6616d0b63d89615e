"""Which values of a forward stay float32 when the compute dtype is lower: one policy, carried by
the model (``Transformer.precision``), so the sampler and every training forward read the same.

The compute dtype (``Transformer.dtype``, e.g. bfloat16) is the dtype of every matmul's operands:
the weights and the activations they multiply. Every product accumulates in float32. What else
is rounded to the compute dtype is the policy's::

    residual          the residual stream x between sublayers (x = x + a, x = x + y) and the
                      RMSNorm outputs read from it
    activations       the products' results until the next product: q, k, v (through q/k norms and
                      RoPE), attention and MLP outputs, gate/up and act(gate) * up
    attention_probs   the softmax probabilities P in o = P V (V is upcast when float32)

each ``"float32"`` or ``"compute"``. Always float32 whatever the policy: norm statistics, attention
scores, the softmax's max / sum / accumulator, the merge of key blocks, the logits and the
log-softmax. With a float32 compute dtype every choice is the same program.

Why it matters: the sampler computes a token's values in a decode step (one row per completion,
keys in cache blocks) and the trainer in a full-sequence forward. The two sum the same products
in another order, so their float32 results differ in the last bits; a value rounded to bfloat16
then differs by a whole bfloat16 step (2^-8 relative) whenever the two straddle a rounding
boundary, and a bfloat16 residual stream carries those steps through every layer. Kept in
float32 the two paths differ only by float32 rounding, and rounding to the compute dtype happens
only at a product's operands, where it rarely flips (``benchmarks/RESULTS.md``, "bfloat16: where
the sampler and the trainer part").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from relax.choices import check_choice

KEEP = ("float32", "compute")


@dataclasses.dataclass(frozen=True)
class Precision:
    """What stays float32 in a low-precision forward (module docstring). The default keeps all
    three in float32: the residual stream does most to bring the sampler's and the trainer's
    log-probs together, the products' results and the attention probabilities each about halve
    what is left on a shallow model (``benchmarks/RESULTS.md``). ``Precision.lowest()``: every
    value in the compute dtype (relax before this policy; the furthest apart)."""

    residual: str = "float32"
    activations: str = "float32"
    attention_probs: str = "float32"

    def __post_init__(self):
        for name in ("residual", "activations", "attention_probs"):
            check_choice(f"precision.{name}", getattr(self, name), KEEP)

    @classmethod
    def lowest(cls) -> Precision:
        return cls(residual="compute", activations="compute", attention_probs="compute")

    def residual_dtype(self, compute):
        """The residual stream's dtype under compute dtype ``compute``."""
        return jnp.float32 if self.residual == "float32" else compute

    def activation_dtype(self, compute):
        """The dtype of a product's result (and what is computed from it before the next product)."""
        return jnp.float32 if self.activations == "float32" else compute

    def probs_dtype(self, compute):
        """The dtype of the softmax probabilities in ``P V``."""
        return jnp.float32 if self.attention_probs == "float32" else compute

    def describe(self, compute) -> str:
        """One line for a run's start-up report."""
        name = jnp.dtype(compute).name
        if name == "float32":
            return "precision: float32 throughout"
        kept = [
            f
            for f in ("residual", "activations", "attention_probs")
            if getattr(self, f) == "float32"
        ]
        return f"precision: {name} matmul operands, float32 accumulation; float32 " + ", ".join(
            ["norm statistics", "softmax", "logits"] + [k.replace("_", " ") for k in kept]
        )
