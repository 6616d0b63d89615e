"""Image prompts' inputs (``relax.models.decoder.prompt_inputs``) in the sampler's prefill and the
prefix-shared training forward: embeddings given in place of the token embeddings, RoPE
positions that are not the token indices, bidirectional blocks (Gemma 3's images), each checked
against the NumPy float64 reference forward over the whole [prompt; completion] sequence, and
sampler log-probs against trainer log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_reference import forward as np_forward

from relax.models import family_config, init
from relax.models.decoder.prompt_inputs import PromptInputs, text_prompt_inputs
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.layers.rope import rotary
from relax.rollout.config import RolloutConfig
from relax.rollout.sampler import generate_program
from relax.rollout.sampling import SamplingConfig

SMALL = dict(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
LLAMA = family_config("llama", **SMALL)
# a sliding layer with a window (3) shorter than the image block, then a full layer
GEMMA = family_config(
    "gemma3_text",
    **SMALL,
    sliding_window=3,
    layer_types=("sliding", "full"),
    rope_local_theta=1e4,
    query_pre_attn_scalar=8.0,
    tie_word_embeddings=True,
)
P, G, N, LP = 2, 2, 4, 8


def _case(cfg, seed=0):
    """A model, left-padded prompts (lengths 8 and 6), and image-like inputs: tokens 2..5 of the
    first prompt's valid tokens and 1..3 of the second's replaced by random features, sharing
    one RoPE position each run (as M-RoPE's image rows do), in one bidirectional block."""
    model = init(cfg, jax.random.key(seed), std=0.3)
    rng = np.random.default_rng(seed)
    lengths = (8, 6)
    ids, mask = np.zeros((P, LP), np.int32), np.zeros((P, LP), np.int32)
    rope_pos, blocks = np.zeros((P, LP), np.int32), np.zeros((P, LP), np.int32)
    image = np.zeros((P, LP), bool)
    for i, (n, span) in enumerate(zip(lengths, ((2, 6), (1, 4)))):
        ids[i, LP - n :] = rng.integers(1, cfg.vocab_size, n)
        mask[i, LP - n :] = 1
        k = np.arange(n)
        a, b = span
        pos = np.where(k < a, k, np.where(k < b, a + (k - a) // 2, k - (b - a) + (b - a + 1) // 2))
        rope_pos[i, LP - n :] = pos
        blocks[i, LP - n + a : LP - n + b] = 1
        image[i, LP - n + a : LP - n + b] = True
    features = rng.standard_normal((P, LP, cfg.hidden_size))
    table = np.asarray(model.embed, np.float64) * (
        np.sqrt(cfg.hidden_size) if cfg.scale_embeddings else 1.0
    )
    embeds = np.where(image[..., None], features, table[ids])  # the reference's prompt inputs
    inputs = PromptInputs(
        features=jnp.asarray(features, jnp.float32),
        is_image=jnp.asarray(image),
        rope=rotary(cfg, jnp.asarray(rope_pos)),
        next_position=jnp.asarray(rope_pos.max(1) + 1),
        blocks=jnp.asarray(blocks),
    )
    return model, jnp.asarray(ids), jnp.asarray(mask), inputs, rope_pos, embeds


def _reference_logprobs(model, ids, mask, inputs, rope_pos, embeds, tokens, temperature=1.0):
    """log p of each completion token by the NumPy reference over [prompt; completion]."""
    cfg = model.config
    n = tokens.shape[-1]
    out = np.zeros(tokens.shape)
    table = np.asarray(model.embed, np.float64) * (
        np.sqrt(cfg.hidden_size) if cfg.scale_embeddings else 1.0
    )
    for p in range(P):
        for g in range(G):
            seq = np.concatenate([np.asarray(ids[p]), np.asarray(tokens[p, g])])[None]
            emb = np.concatenate([embeds[p], table[np.asarray(tokens[p, g])]])[None]
            nxt = int(inputs.next_position[p])
            pos = np.concatenate([rope_pos[p], nxt + np.arange(n)])[None]
            blk = np.concatenate([np.asarray(inputs.blocks[p]), np.zeros(n, int)])[None]
            valid = np.concatenate([np.asarray(mask[p]), np.ones(n, int)])[None]
            logits = (
                np_forward(model, seq, valid, embeds=emb, rope_positions=pos, blocks=blk)[0]
                / temperature
            )
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            pred = logits[LP - 1 : LP - 1 + n] - lse[LP - 1 : LP - 1 + n, None]
            out[p, g] = pred[np.arange(n), np.asarray(tokens[p, g])]
    return out


def _tokens(cfg, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(1, cfg.vocab_size, (P, G, N)))


@pytest.mark.parametrize(
    "cfg,attention,groups_per_pass",
    [(LLAMA, "group", None), (LLAMA, "group", 1), (LLAMA, "dense", None), (GEMMA, "group", None)],
    ids=["llama-group", "llama-group-tiled", "llama-dense", "gemma3-group"],
)
def test_trainer_logprobs_equal_reference(cfg, attention, groups_per_pass):
    model, ids, mask, inputs, rope_pos, embeds = _case(cfg)
    tokens = _tokens(cfg)
    how = ForwardPass(attention=attention, groups_per_pass=groups_per_pass)
    got = completion_logprobs(model, ids, mask, tokens, jnp.ones_like(tokens), how, prompt=inputs)
    want = _reference_logprobs(model, ids, mask, inputs, rope_pos, embeds, tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    # the same prompt without its inputs gives other values: the test sees them
    plain = completion_logprobs(model, ids, mask, tokens, jnp.ones_like(tokens), how)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2


def test_text_inputs_are_the_default():
    model, ids, mask, *_ = _case(GEMMA)
    tokens = _tokens(GEMMA)
    text = text_prompt_inputs(model, ids, mask)
    how = ForwardPass(attention="group")
    a = completion_logprobs(model, ids, mask, tokens, jnp.ones_like(tokens), how, prompt=text)
    b = completion_logprobs(model, ids, mask, tokens, jnp.ones_like(tokens), how)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("cfg", [LLAMA, GEMMA], ids=["llama", "gemma3"])
@pytest.mark.slow
def test_sampler_logprobs_equal_trainer_logprobs(cfg):
    model, ids, mask, inputs, rope_pos, embeds = _case(cfg)
    rc = RolloutConfig(
        num_generations=G,
        max_new_tokens=N,
        sampling=SamplingConfig(temperature=0.9),
        eos_ids=(),
        cache_chunk=2,
    )
    run = jax.jit(generate_program, static_argnames="cfg")
    r = run(model, ids, mask, jax.random.key(5), cfg=rc, prompt=inputs)
    assert np.all(np.asarray(r.mask) == 1)
    how = ForwardPass(attention="group")
    train = completion_logprobs(
        model, ids, mask, r.tokens, r.mask, how, prompt=inputs, temperature=0.9
    )
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(train), atol=2e-5, rtol=0)
    want = _reference_logprobs(model, ids, mask, inputs, rope_pos, embeds, r.tokens, 0.9)
    np.testing.assert_allclose(np.asarray(r.logprobs), want, atol=2e-5, rtol=0)
    # the sampler with the text prompt draws from other distributions: the inputs reached it
    t = run(model, ids, mask, jax.random.key(5), cfg=rc)
    assert not np.allclose(np.asarray(t.logprobs), np.asarray(r.logprobs), atol=1e-3)


def test_packed_bins_refuse_prompt_inputs():
    model, ids, mask, inputs, *_ = _case(LLAMA)
    tokens = _tokens(LLAMA)
    with pytest.raises(ValueError, match="padded rows"):
        completion_logprobs(
            model, ids, mask, tokens, jnp.ones_like(tokens), packed=object(), prompt=inputs
        )


@pytest.mark.slow
def test_the_prompt_text_embeddings_get_their_gradient():
    """The layers' input is looked up inside the differentiated forward: with no image token the
    gradient through ``PromptInputs`` is the plain forward's, embedding table included."""
    model, ids, mask, *_ = _case(LLAMA)
    tokens = _tokens(LLAMA)
    inputs = text_prompt_inputs(model, ids, mask)
    how = ForwardPass(attention="group")

    def loss(m, prompt):
        lp = completion_logprobs(m, ids, mask, tokens, jnp.ones_like(tokens), how, prompt=prompt)
        return jnp.sum(lp)

    a = jax.grad(loss)(model, inputs)
    b = jax.grad(loss)(model, None)
    assert float(jnp.abs(b.embed[ids[0, -1]]).max()) > 0  # a prompt token's row is trained
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)
