"""The training forward over bins: prompts and completions of several groups packed in one
stream per bin (``relax.models.forward.completion_packing``), each completion as if alone
behind its prompt.

Every bin runs through the layers as one row of ``S`` slots at its slots' own positions; the
attention (``bins_attend``) is ``relax.models.attention.stream``'s over the blocks that hold a
visible key only (the ``"group"`` train attention), or one fused kernel per bin over the dense
mask (``"dense"``: cuDNN's on a GPU in 16 bits)::

    allowed(i, j) = doc_j == doc_i  |  (j is a prompt token & prompt_j == prompt_i),
                    & pos_j <= pos_i  (& within the window on sliding layers)

so a completion's token sees its prompt copy and its own earlier tokens, and the cost of a
bin's block-sparse attention follows ``sum (len_prompt + len)^2`` over what it holds, not
``S^2``. The hidden state that predicts slot ``s``'s token is the one at ``predictor[s]`` (the
slot before, or the prompt's last slot for a completion's first token); log-probs, entropies
and values are read from those states per slot and brought back to ``[P, G, N]``
(``to_padded``) or to a micro-batch's member rows (``to_rows``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.models.attention.stream import StreamMask
from relax.models.config.sharding import ambient_batch_shards, rows_over_batch
from relax.models.decoder.logprobs import logprobs_and_entropy_from_hidden, logprobs_from_hidden
from relax.models.decoder.transformer import Attend, LayerRoutes, Transformer, embed, run_layers
from relax.models.forward.completion_packing import CompletionBins, to_padded
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.routes import Routes
from relax.models.forward.stream_rows import masked_attend, stream_attend
from relax.models.layers.rope import Rotary
from relax.models.moe.experts import RouterStats

__all__ = [
    "binned_hidden",
    "binned_logprobs",
    "bins_hidden",
    "bins_logprobs",
    "block_of",
    "over_bins",
]


def block_of(bins: CompletionBins) -> int:
    """The attention block of the bins' pair lists (``W = nb (nb + 1) / 2``, ``block = S / nb``)."""
    w, s = bins.pairs.shape[-2], bins.ids.shape[-1]
    nb = (math.isqrt(8 * w + 1) - 1) // 2
    return s // nb


def bins_attend(model: Transformer, bins: CompletionBins, attention: str) -> Attend:
    """The attention hook of a micro-batch of bins (``relax.models.forward.stream_rows``): the
    block-sparse loop for the ``"group"`` train attention, one fused masked kernel per bin for
    ``"dense"``."""
    mask = StreamMask(bins.positions, bins.docs, bins.prefix_of, bins.prefix)
    if attention == "dense":
        return masked_attend(model, mask)
    return stream_attend(model, mask, bins.pairs, bins.num_pairs, block_of(bins))


def bins_hidden(
    model: Transformer,
    bins: CompletionBins,
    layers: ForwardPass,
    recorded: Array | None = None,
    rope: Rotary | None = None,
) -> tuple[Float[Array, "b s d"], RouterStats | None]:
    """The final-norm hidden state that predicts each slot's token, ``[b, S, D]``, and a mixture
    of experts' ``RouterStats`` over the bins' tokens (None for a dense model); ``recorded``:
    the experts a sampler chose per slot ``[b, S, Ls, k]`` (``Routes.replay_slots``), replayed
    when ``layers.replay_routes``; ``rope``: the rotary tables of ``bins.positions`` when the
    caller computed them outside its loop (``relax.models.forward.prefix_shared.completion_rope``
    says why)."""
    bins, recorded, rope = rows_over_batch((bins, recorded, rope))  # each device its own bins
    if recorded is not None:
        recorded = jnp.moveaxis(recorded, 2, 0)  # layer-major [Ls, b, S, k]
    h, _, routed = run_layers(
        model,
        embed(model, bins.ids),
        bins.positions,
        bins_attend(model, bins, layers.attention),
        remat=layers.remat,
        rope=rope,
        routes=LayerRoutes(bins.docs > 0, recorded, layers.replay_routes),
    )
    h = jnp.take_along_axis(h, bins.predictor[..., None], axis=1)
    return h, None if routed is None else routed.stats


def bins_logprobs(
    model: Transformer,
    bins: CompletionBins,
    layers: ForwardPass,
    *,
    temperature: float = 1.0,
    recorded: Array | None = None,
    rope: Rotary | None = None,
):
    """``log p(slot token | its prompt and completion before it)`` per slot ``[b, S]`` (float32;
    meaningless on prompt and padding slots), with ``layers.with_entropy`` also the entropies
    (a pair); and the ``RouterStats`` (``bins_hidden``, its ``recorded`` and ``rope``)."""
    h, stats = bins_hidden(model, bins, layers, recorded, rope)
    kw = dict(temperature=temperature, chunk_size=layers.chunk_size)
    if layers.with_entropy:
        out = logprobs_and_entropy_from_hidden(
            model, h, bins.ids, entropy_grad=layers.entropy_grad, **kw
        )
    else:
        out = logprobs_from_hidden(model, h, bins.ids, **kw)
    return out, stats


def over_bins(run, xs, active: Bool[Array, " u"], *, summed: bool = False, per_device: int = 1):
    """``run(xs)`` over the bins a few at a time (a ``lax.map``: ``per_device`` bins per step on
    one device, as many local bins per device per step on a mesh; where they do not divide the
    bins, one per device, or all at once), each step skipped when none of its bins is ``active``
    (its outputs zeros). Every leaf of ``xs`` leads with ``[U]``; ``run`` returns per-bin outputs
    leading with the step's bins; ``summed``: ``(per-bin outputs, totals)``, the totals added
    over the steps."""
    u = active.shape[0]
    shards = ambient_batch_shards()
    per_step = next((k for k in (shards * per_device, shards) if u % k == 0), u)
    tiles = jax.tree.map(lambda x: x.reshape((u // per_step, per_step) + x.shape[1:]), xs)
    on = active.reshape(u // per_step, per_step).any(-1)
    shape = jax.eval_shape(run, jax.tree.map(lambda x: x[0], tiles))

    def step(args):
        tile, go = args
        return jax.lax.cond(
            go,
            run,
            lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape),
            tile,
        )

    out = jax.lax.map(step, (tiles, on))
    merge = lambda x: x.reshape((u,) + x.shape[2:])  # noqa: E731
    if summed:
        return jax.tree.map(merge, out[0]), jax.tree.map(lambda x: x.sum(0), out[1])
    return jax.tree.map(merge, out)


def binned_logprobs(
    model: Transformer,
    bins: CompletionBins,
    how: ForwardPass,
    n: int,
    *,
    temperature: float = 1.0,
    routes: Routes | None = None,
    rope: Rotary | None = None,
):
    """``relax.models.forward.prefix_shared.completion_logprobs`` over bins: ``(out, stats)``,
    ``out`` the ``[P, G, N]`` log-probs (with ``how.with_entropy`` a pair with the entropies),
    ``stats`` the summed ``RouterStats`` (None for a dense model); ``routes`` replayed per slot;
    ``rope``: the bins' rotary tables (None: computed per bin)."""
    layers = how.resolved(model)
    own = bins.per_bin()
    recorded = None if routes is None else routes.replay_slots(bins.source)

    def run(args):
        tile, rec, rot = args
        return bins_logprobs(model, tile, layers, temperature=temperature, recorded=rec, rope=rot)

    out, stats = over_bins(
        run, (own, recorded, rope), bins.num_pairs > 0, summed=True, per_device=layers.bins_per_pass
    )
    back = lambda x: to_padded(x, bins, n)  # noqa: E731
    return (tuple(map(back, out)) if layers.with_entropy else back(out)), stats


def binned_hidden(
    model: Transformer, bins: CompletionBins, how: ForwardPass, *, rope: Rotary | None = None
) -> Float[Array, "u s d"]:
    """``bins_hidden`` over every bin of a batch (``over_bins``), ``[U, S, D]``; ``rope``: the
    bins' rotary tables (None: computed per bin)."""
    layers = how.resolved(model)
    run = lambda xs: bins_hidden(model, xs[0], layers, rope=xs[1])[0]  # noqa: E731
    return over_bins(
        run, (bins.per_bin(), rope), bins.num_pairs > 0, per_device=layers.bins_per_pass
    )
