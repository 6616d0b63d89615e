"""The critic: values against the plain forward, one forward for log-probs and values, gradients,
and Hugging Face value-model directories (transformers loads them; relax reads them back)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf import random_model, tiny

from relax.models import hidden_states
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.heads.critic import (
    Critic,
    ValueHead,
    completion_logprobs_and_values,
    completion_values,
    init_critic,
    init_value_head,
    load_critic,
    save_critic,
)
from relax.models.hf.checkpoint import HFFormatError, save_pretrained

P, G, N, LP = 2, 2, 5, 6


def _batch(vocab, seed=0):
    """Left-padded prompts of lengths 6 and 3; completions with trailing padding."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, vocab, (P, LP))
    prompt_mask = np.ones((P, LP), np.int32)
    prompt_mask[1, :3] = 0
    tokens = rng.integers(0, vocab, (P, G, N))
    mask = np.ones((P, G, N), np.int32)
    mask[0, 1, 3:] = 0
    mask[1, 0, 4:] = 0
    return tuple(jnp.asarray(a, jnp.int32) for a in (prompt_ids, prompt_mask, tokens, mask))


def _sequences(batch):
    """The concatenated ``[prompt; completion]`` rows ``[P*G, LP+N]`` (ids, mask)."""
    prompt_ids, prompt_mask, tokens, mask = (np.asarray(a) for a in batch)
    rep = lambda a: np.repeat(a, G, axis=0)
    ids = np.concatenate([rep(prompt_ids), tokens.reshape(P * G, N)], axis=1)
    return ids, np.concatenate([rep(prompt_mask), mask.reshape(P * G, N)], axis=1)


def _critic(name, seed=0, bias=0.0):
    backbone = random_model(tiny(name), seed)
    head = (
        np.random.default_rng(seed + 1)
        .standard_normal(backbone.config.hidden_size)
        .astype(np.float32)
    )
    return Critic(backbone, jnp.asarray(0.5 * head), jnp.asarray(bias, jnp.float32))


_values = jax.jit(completion_values)
CFG = "qwen3_gqa_head_dim"  # untied, q/k norms, GQA


def test_values_match_the_plain_forward():
    """values[p, g, t] = h . head + b with h the plain forward's hidden state at the position that
    predicts token t of [prompt; completion] (the last prompt position for t = 0)."""
    critic = _critic(CFG, bias=0.3)
    batch = _batch(critic.backbone.config.vocab_size)
    ids, seq_mask = _sequences(batch)
    h = np.asarray(
        hidden_states(critic.backbone, jnp.asarray(ids), jnp.asarray(seq_mask)), np.float64
    )
    want = h[:, LP - 1 : LP + N - 1] @ np.asarray(critic.head, np.float64) + 0.3
    got = np.asarray(_values(critic, *batch)).reshape(P * G, N)
    assert got.dtype == np.float32
    valid = np.asarray(batch[3]).reshape(P * G, N).astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-5, rtol=0)
    assert np.all(np.isfinite(got))


def test_policy_value_head_shares_the_forward():
    policy = random_model(tiny(CFG))
    critic = _critic(CFG, bias=-0.2)
    head = ValueHead(critic.head, critic.bias)
    batch = _batch(policy.config.vocab_size, seed=1)
    lp, ent, v = jax.jit(
        lambda m, h, *b: completion_logprobs_and_values(m, h, *b, temperature=0.7)
    )(policy, head, *batch)
    lp_ref, ent_ref = jax.jit(
        lambda m, *b: completion_logprobs(m, *b, ForwardPass(with_entropy=True), temperature=0.7)
    )(policy, *batch)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(lp_ref))
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent_ref))
    # the same values as a critic on the policy's backbone, with or without its lm_head
    for backbone in (policy, init_critic(policy).backbone):
        np.testing.assert_allclose(
            np.asarray(v),
            np.asarray(_values(Critic(backbone, head.head, head.bias), *batch)),
            atol=1e-6,
            rtol=0,
        )


def test_init_critic_copies_the_policy():
    policy = random_model(tiny(CFG))
    critic = init_critic(policy)
    assert critic.backbone.lm_head is None and critic.backbone.config.tie_word_embeddings
    assert critic.backbone.embed.unsafe_buffer_pointer() != policy.embed.unsafe_buffer_pointer()
    np.testing.assert_array_equal(
        np.asarray(critic.backbone.layers.wq), np.asarray(policy.layers.wq)
    )
    assert critic.head.shape == (policy.config.hidden_size,) and not np.any(np.asarray(critic.head))
    assert critic.bias.shape == () and float(critic.bias) == 0.0
    batch = _batch(policy.config.vocab_size)
    assert not np.any(np.asarray(_values(critic, *batch)))  # V = 0 to start
    noisy = init_critic(policy, key=jax.random.key(3), head_std=0.1)
    assert 0.05 < float(jnp.std(noisy.head)) < 0.2
    vh = init_value_head(policy.config, 0.1, key=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(vh.head), np.asarray(noisy.head))
    with pytest.raises(ValueError, match="needs a key"):
        init_critic(policy, head_std=0.1)


@pytest.mark.slow
def test_value_gradients_match_finite_differences():
    critic = _critic(CFG, bias=0.1)
    batch = _batch(critic.backbone.config.vocab_size, seed=2)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((P, G, N)), jnp.float32) * batch[3]
    f = jax.jit(lambda c: jnp.sum(completion_values(c, *batch) * w))
    grads = jax.grad(f)(critic)
    np.testing.assert_allclose(float(grads.bias), float(jnp.sum(w)), rtol=1e-5)

    rng = np.random.default_rng(5)
    direction = lambda tree: jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), tree
    )

    def check(u, eps, rtol):  # d/de f(c + e u) against <grad f, u>, central differences
        plus = jax.tree.map(lambda x, d: x + eps * d, critic, u)
        minus = jax.tree.map(lambda x, d: x - eps * d, critic, u)
        fd = (float(f(plus)) - float(f(minus))) / (2 * eps)
        ad = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(u)))
        np.testing.assert_allclose(ad, fd, rtol=rtol)
        assert abs(ad) > 1e-2  # a direction that moves the values

    zeros = jax.tree.map(jnp.zeros_like, critic)
    check(
        Critic(zeros.backbone, direction(critic.head), zeros.bias), 1e-1, 1e-3
    )  # values are linear in head
    check(
        Critic(direction(critic.backbone), zeros.head, zeros.bias), 1e-3, 2e-2
    )  # through the prefix-shared forward


# ----------------------------------------------------------------------------- Hugging Face directories


def _hf_scores(hf, ids, mask):
    """transformers' per-token score ``[B, T]`` (its backbone, then ``score``)."""
    import torch

    with torch.no_grad():
        out = hf.model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)),
        )
        return hf.score(out.last_hidden_state)[..., 0].float().numpy()


@pytest.mark.parametrize(
    "name, bias",
    [
        ("qwen3_gqa_head_dim", 0.0),
        ("gemma3_mixed_tied", 0.0),
        ("llama2_mha_untied", 0.25),
        ("phi3_gqa_window", 0.25),
        ("phi3_longrope_tied", 0.0),
    ],
)
def test_saved_critic_loads_in_transformers(name, bias, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    critic = _critic(name, bias=bias)
    batch = _batch(critic.backbone.config.vocab_size, seed=3)
    save_critic(critic, tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    assert "lm_head.weight" not in tensors and tensors["score.weight"].shape == (
        1,
        critic.backbone.config.hidden_size,
    )
    token = bias != 0.0  # the auto layout: a bias needs a ...ForTokenClassification
    auto = (
        transformers.AutoModelForTokenClassification
        if token
        else transformers.AutoModelForSequenceClassification
    )
    hf = auto.from_pretrained(tmp_path / "c", dtype=torch.float32).eval()
    assert type(hf).__name__ == config["architectures"][0]
    assert type(hf).__name__.endswith(
        "ForTokenClassification" if token else "ForSequenceClassification"
    )
    assert hf.config.num_labels == 1 and ("score.bias" in tensors) == token
    ids, mask = _sequences(batch)
    want = _hf_scores(hf, ids, mask)[:, LP - 1 : LP + N - 1]
    got = np.asarray(_values(critic, *batch)).reshape(P * G, N)
    valid = np.asarray(batch[3]).reshape(P * G, N).astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)

    # relax reads its own directory and transformers' save of it back to the same critic
    hf.save_pretrained(tmp_path / "hf")
    saved = Critic(
        init_critic(critic.backbone).backbone, critic.head, critic.bias
    )  # without the lm_head
    for d in (tmp_path / "c", tmp_path / "hf"):
        back = load_critic(d)
        assert back.backbone.config == saved.backbone.config and back.backbone.lm_head is None
        assert jax.tree.structure(back) == jax.tree.structure(saved)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sequence_layout_refuses_a_bias(tmp_path):
    critic = _critic(CFG, bias=0.5)
    with pytest.raises(ValueError, match="ForSequenceClassification's score has no bias"):
        save_critic(critic, tmp_path / "c", layout="sequence")
    with pytest.raises(ValueError, match="no token-classification model for 'gemma3_text'"):
        save_critic(_critic("gemma3_mixed_tied"), tmp_path / "g", layout="token")
    assert not (tmp_path / "c").exists()


def test_bad_critic_directories(tmp_path):
    critic = _critic(CFG)
    save_pretrained(critic.backbone, tmp_path / "policy")
    with pytest.raises(
        HFFormatError, match=r"policy/model\.safetensors: no tensor 'score\.weight'.*causal LM"
    ):
        load_critic(tmp_path / "policy")

    save_critic(critic, tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    tensors = load_file(path)
    save_file(
        {**tensors, "score.weight": np.zeros((2, 64), np.float32)}, path, metadata={"format": "pt"}
    )
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: tensor 'score\.weight' has shape \[2, 64\], "
        r"expected \[1, 64\]",
    ):
        load_critic(tmp_path / "c")
    save_file(
        {**tensors, "score.bias": np.zeros((1,), np.float32)}, path, metadata={"format": "pt"}
    )
    with pytest.raises(HFFormatError, match=r"model\.safetensors: unexpected tensor 'score\.bias'"):
        load_critic(tmp_path / "c")
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = tmp_path / "c" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(HFFormatError, match=r"config\.json: field 'id2label'.*num_labels=1"):
        load_critic(tmp_path / "c")
