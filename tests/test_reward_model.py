"""Reward models: scores against transformers' sequence classifiers (right- and left-padded), the
directory round trip and its errors, Bradley-Terry training, gradient accumulation, and the
reward model as a token reward for GRPO / PPO."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file
from test_hf import random_model, tiny

from relax.algorithms.online.batch import HostRecord, Sampled
from relax.algorithms.online.stages import make_score
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.loss import make_loss, pair_normalizers
from relax.algorithms.reward_model.step import (
    evaluate_pairs,
    init_reward_model_state,
    make_reward_model_step,
    pair_data,
)
from relax.compose import WithHost
from relax.data.pairs import PairBatch
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import ForwardPass
from relax.models.heads.critic import save_critic
from relax.models.heads.reward_model import (
    RewardModel,
    init_reward_model,
    load_reward_model,
    save_reward_model,
    sequence_rewards,
)
from relax.models.hf.checkpoint import HFFormatError, save_pretrained
from relax.passes import Passes
from relax.rewards.functions import RewardFunction
from relax.rewards.model import RewardModelScorer, reward_model_reward
from relax.rewards.token_rewards import TokenRewardFunction, score_tokens
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state
from relax.train.update import make_update

P, G, N, LP = 3, 2, 5, 6
PAD = 0
_rewards = jax.jit(sequence_rewards)


def _reward_model(name, seed=0):
    backbone = random_model(tiny(name, pad_token_id=PAD), seed)
    head = (
        np.random.default_rng(seed + 1)
        .standard_normal(backbone.config.hidden_size)
        .astype(np.float32)
    )
    return RewardModel(init_reward_model(backbone, head_std=0.0).backbone, jnp.asarray(0.5 * head))


def _batch(vocab, seed=0):
    """Left-padded prompts (lengths 6, 3, 1); right-padded completions, one of them empty and one
    ending in a token equal to the pad id (pad = eos: scored at the token before it)."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(1, vocab, (P, LP))
    prompt_mask = np.ones((P, LP), np.int32)
    prompt_mask[1, :3] = 0
    prompt_mask[2, :5] = 0
    tokens = rng.integers(1, vocab, (P, G, N))
    mask = np.ones((P, G, N), np.int32)
    mask[0, 1, 3:] = 0
    mask[1, 0, 4:] = 0
    mask[2, 1, :] = 0  # an empty completion: scored at the prompt's last token
    tokens[1, 1, 4] = PAD  # a valid token equal to the pad id
    prompt_ids[prompt_mask == 0] = PAD
    tokens[mask == 0] = PAD
    return tuple(jnp.asarray(a, jnp.int32) for a in (prompt_ids, prompt_mask, tokens, mask))


def _sequences(batch, *, left: bool):
    """Each ``prompt ++ completion`` with its valid tokens only, padded with PAD to ``LP + N`` on
    the right or on the left, as transformers sees them (ids, attention mask) ``[P*G, LP+N]``."""
    prompt_ids, prompt_mask, tokens, mask = (np.asarray(a) for a in batch)
    ids = np.full((P * G, LP + N), PAD, np.int64)
    att = np.zeros((P * G, LP + N), np.int64)
    for p in range(P):
        for g in range(G):
            row = np.concatenate([prompt_ids[p][prompt_mask[p] > 0], tokens[p, g][mask[p, g] > 0]])
            sl = slice(LP + N - len(row), LP + N) if left else slice(0, len(row))
            ids[p * G + g, sl], att[p * G + g, sl] = row, 1
    return ids, att


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_gqa_head_dim",
        pytest.param("gemma3_mixed_tied", marks=pytest.mark.slow),
        pytest.param("llama3_gqa_tied", marks=pytest.mark.slow),
    ],
)
def test_saved_reward_model_scores_like_transformers(name, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rm = _reward_model(name)
    batch = _batch(rm.config.vocab_size, seed=3)
    save_reward_model(rm, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    tensors = load_file(tmp_path / "rm" / "model.safetensors")
    assert (
        config["architectures"][0].endswith("ForSequenceClassification")
        and config["pad_token_id"] == PAD
    )
    assert "score.bias" not in tensors and "lm_head.weight" not in tensors
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == config["architectures"][0] and hf.config.num_labels == 1
    got = np.asarray(_rewards(rm, *batch)).reshape(P * G)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    for left in (False, True):
        ids, att = _sequences(batch, left=left)
        with torch.no_grad():  # transformers' own call: positions 0.. including the left padding
            want = (
                hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(att))
                .logits[:, 0]
                .numpy()
            )
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"left={left}")


def test_reward_is_read_at_the_last_valid_token():
    """Changing a masked token or a token after the read position changes nothing; the pad-id rule
    can be turned off (then the token equal to the pad id is read)."""
    rm = _reward_model("qwen3_gqa_head_dim")
    prompt_ids, prompt_mask, tokens, mask = _batch(rm.config.vocab_size)
    r = np.asarray(_rewards(rm, prompt_ids, prompt_mask, tokens, mask))
    garbage = jnp.where(mask > 0, tokens, 5)
    np.testing.assert_allclose(
        np.asarray(_rewards(rm, prompt_ids, prompt_mask, garbage, mask)), r, atol=1e-6
    )
    plain = np.asarray(
        jax.jit(lambda *b: sequence_rewards(rm, *b, ignore_pad_tokens=False))(
            prompt_ids, prompt_mask, tokens, mask
        )
    )
    changed = np.zeros((P, G), bool)
    changed[1, 1] = True  # the completion ending in the pad id
    np.testing.assert_allclose(plain[~changed], r[~changed], atol=1e-6)
    assert abs(plain[1, 1] - r[1, 1]) > 1e-4
    grouped = jax.jit(lambda *b: sequence_rewards(rm, *b, ForwardPass(groups_per_pass=1)))(
        prompt_ids, prompt_mask, tokens, mask
    )
    np.testing.assert_allclose(np.asarray(grouped), r, atol=1e-5)


def test_load_round_trip_and_config(tmp_path):
    policy = random_model(tiny("llama2_mha_untied"))
    rm = init_reward_model(policy, jax.random.key(1), pad_token_id=3)
    assert (
        rm.config.pad_token_id == 3
        and rm.config is rm.backbone.config
        and rm.backbone.lm_head is None
    )
    assert 0.01 < float(jnp.std(rm.head)) < 0.03
    with pytest.raises(ValueError, match="needs a key"):
        init_reward_model(policy)

    class Tok:  # anything with save_pretrained(directory)
        def save_pretrained(self, directory):
            (tmp_path / "rm" / "tokenizer.json").write_text("{}")

    save_reward_model(rm, tmp_path / "rm", tokenizer=Tok())
    assert (tmp_path / "rm" / "tokenizer.json").exists()
    back = load_reward_model(tmp_path / "rm")
    assert back.config == rm.config and jax.tree.structure(back) == jax.tree.structure(rm)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(rm)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_reward_model_directories(tmp_path):
    rm = _reward_model("qwen3_gqa_head_dim")
    save_pretrained(rm.backbone, tmp_path / "policy")
    with pytest.raises(
        HFFormatError,
        match=r"policy/model\.safetensors: no tensor 'score\.weight'.*"
        r"causal LM.*init_reward_model",
    ):
        load_reward_model(tmp_path / "policy")
    critic = rm.as_critic()
    save_critic(type(critic)(critic.backbone, critic.head, jnp.float32(0.5)), tmp_path / "token")
    with pytest.raises(
        HFFormatError, match=r"token/config\.json: field 'architectures'.*ForTokenClassification"
    ):
        load_reward_model(tmp_path / "token")

    save_reward_model(rm, tmp_path / "rm")
    path = tmp_path / "rm" / "model.safetensors"
    tensors = load_file(path)
    save_file(
        {**tensors, "score.weight": np.zeros((2, 64), np.float32)}, path, metadata={"format": "pt"}
    )
    with pytest.raises(
        HFFormatError, match=r"rm/model\.safetensors: tensor 'score\.weight' has shape \[2, 64\]"
    ):
        load_reward_model(tmp_path / "rm")
    save_file(
        {**tensors, "score.bias": np.zeros((1,), np.float32)}, path, metadata={"format": "pt"}
    )
    with pytest.raises(
        HFFormatError, match=r"rm/model\.safetensors: unexpected tensor 'score\.bias'"
    ):
        load_reward_model(tmp_path / "rm")
    del tensors["score.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"rm/model\.safetensors: no tensor 'score\.weight'"):
        load_reward_model(tmp_path / "rm")


# ----------------------------------------------------------------------------- training


def _pairs(rng, n, vocab=97, lp=4, n_tok=4):
    """A synthetic preference set: random prompts and completions (lengths vary, right-padded); a
    chosen completion ends in a token of 10..29, a rejected one in 40..59."""
    prompt_ids = rng.integers(1, vocab, (n, lp))
    prompt_mask = np.ones((n, lp), np.int32)
    prompt_mask[:, :1] = rng.integers(0, 2, (n, 1))
    tokens = rng.integers(1, vocab, (n, 2, n_tok))
    lengths = rng.integers(1, n_tok + 1, (n, 2))
    mask = (np.arange(n_tok) < lengths[..., None]).astype(np.int32)
    last = lambda g: (np.arange(n), g, lengths[:, g] - 1)  # noqa: E731
    tokens[last(0)] = rng.integers(10, 30, n)
    tokens[last(1)] = rng.integers(40, 60, n)
    prompt_ids[prompt_mask == 0], tokens[mask == 0] = PAD, PAD
    return PairBatch(
        prompt_ids=prompt_ids.astype(np.int32),
        prompt_mask=prompt_mask,
        tokens=tokens.astype(np.int32),
        mask=mask,
    )


@pytest.mark.slow  # the command line's learning test (tests/test_offline.py) is the fast one
def test_bradley_terry_training_raises_held_out_accuracy():
    rng = np.random.default_rng(0)
    cfg = RewardModelConfig(grad_accum=1, optimizer=OptimizerConfig(learning_rate=3e-3))
    state = init_reward_model_state(
        cfg, random_model(tiny("qwen3_gqa_head_dim", pad_token_id=PAD)), jax.random.key(0)
    )
    assert isinstance(state.policy, RewardModel) and state.policy.config.vocab_size == 97
    held_out = _pairs(np.random.default_rng(99), 64)
    before = evaluate_pairs(state.policy, held_out)
    step = make_reward_model_step(cfg, Passes())
    losses = []
    for _ in range(30):
        state, out = step(state, jax.tree.map(jnp.asarray, _pairs(rng, 16)))
        losses.append(float(out.metrics["loss"]))
    m, health = out.metrics, out.health
    assert {
        "loss",
        "accuracy",
        "margin",
        "rewards/chosen",
        "rewards/rejected",
        "grad_norm",
        "skipped_updates",
    } <= set(m)
    assert {k: int(v) for k, v in health.items()} == {
        "first_nonfinite_grad": -1,
        "first_nonfinite": -1,
        "consecutive_skips": 0,
    }
    assert int(state.step) == 30
    after = evaluate_pairs(state.policy, held_out)
    sliced = evaluate_pairs(state.policy, held_out, pairs_per_pass=24)  # 24 + 24 + 16 (+ 8 padding)
    assert sliced.keys() == after.keys()
    for k in after:
        np.testing.assert_allclose(sliced[k], after[k], atol=1e-5, err_msg=k)
    assert before["accuracy"] < 0.75 and after["accuracy"] >= 0.9, (before, after)
    assert after["margin"] > before["margin"] + 1.0
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


@pytest.mark.parametrize("center, margin", [(None, False), (0.01, True)])
@pytest.mark.slow
def test_grad_accumulation_does_not_change_the_update(center, margin):
    rm = _reward_model("qwen3_gqa_head_dim")
    batch = jax.tree.map(jnp.asarray, _pairs(np.random.default_rng(1), 4))
    if margin:  # and a padding pair, which counts nowhere
        batch = dataclasses.replace(
            batch,
            margin=jnp.asarray([0.0, 0.5, -0.3, 1.0], jnp.float32),
            loss_mask=jnp.asarray([1, 1, 0, 1], jnp.int32),
        )
    data = pair_data(batch, rm.config)
    cfg = RewardModelConfig(center_rewards_coefficient=center)
    outs = []
    for accum in (1, 2):
        opt = optax.sgd(0.1)
        update = jax.jit(
            make_update(
                make_loss(cfg, Passes()), opt, grad_accum=accum, normalizers=pair_normalizers
            )
        )
        outs.append(update(rm, opt.init(rm), data, jax.random.key(0)))
    (m1, _, met1), (m2, _, met2) = outs
    for k in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "grad_norm"):
        np.testing.assert_allclose(float(met1[k]), float(met2[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert not np.allclose(np.asarray(m1.head), np.asarray(rm.head))
    # the loss is the mean over the real pairs of the batch (before the step)
    r = np.asarray(
        _rewards(rm, batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.mask), np.float64
    )
    diff = r[:, 0] - r[:, 1] - (np.zeros(4) if batch.margin is None else np.asarray(batch.margin))
    per = np.log1p(np.exp(-diff)) + (center or 0.0) * (r[:, 0] + r[:, 1]) ** 2
    real = (np.ones(4) if batch.loss_mask is None else np.asarray(batch.loss_mask)) > 0
    np.testing.assert_allclose(float(met1["loss"]), per[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(met1["accuracy"]), np.mean(r[real, 0] > r[real, 1]), rtol=1e-6)


def test_the_step_state_has_the_models_config():
    cfg = RewardModelConfig()
    rm = _reward_model("qwen3_gqa_head_dim")
    state = init_reward_model_state(cfg, rm, jax.random.key(0))
    assert state.policy is rm and state.policy.config.num_layers == 2
    init_state(rm, cfg.optimizer.make(), key=jax.random.key(0))  # a plain TrainState holds it too
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardModelConfig(center_rewards_coefficient=-1.0)
    with pytest.raises(ValueError, match="train_attention"):
        RewardModelConfig(forward=ForwardConfig(train_attention="flash"))


# ----------------------------------------------------------------------------- as a reward


@pytest.mark.slow
def test_token_reward_matches_sequence_rewards():
    rm = _reward_model("qwen3_gqa_head_dim")
    prompt_ids, prompt_mask, tokens, mask = _batch(rm.config.vocab_size, seed=5)
    want = np.asarray(_rewards(rm, prompt_ids, prompt_mask, tokens, mask))
    fn = reward_model_reward(rm, name="rm", weight=2.0)
    other = reward_model_reward(rm, name="rm_grouped", groups_per_pass=1)
    assert isinstance(fn, TokenRewardFunction) and isinstance(fn.fn, RewardModelScorer)
    assert hash(fn) == hash(fn) and fn.fn != other.fn and fn.fn == fn.fn  # identity: a jit static
    total, per = score_tokens(
        [fn, other], prompt_ids, prompt_mask.astype(bool), tokens, mask.astype(bool)
    )
    np.testing.assert_allclose(np.asarray(per["rm"]), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(per["rm_grouped"]), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(total), 3 * want, atol=1e-4)
    # as GRPO / PPO's score stage runs it (a host stage, the token reward jitted on the arrays), next
    # to a host reward function
    one = RewardFunction(lambda prompts, completions, **_: [1.0] * len(completions), name="one")
    score = make_score([fn, one], decode=lambda tokens, mask: ["x"] * len(tokens))
    rollout = Sampled(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        tokens=tokens,
        mask=mask,
        old_logprobs=jnp.zeros((P, G, N)),
        lengths=jnp.sum(mask, -1),
        finished=jnp.ones((P, G), bool),
        policy_version=jnp.zeros((P, G), jnp.int32),
    )
    _, out = score(None, WithHost(rollout, HostRecord(prompts=["p"] * P, fields={})))
    np.testing.assert_allclose(np.asarray(out.device.reward_parts["rm"]), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.device.rewards), 2 * want + 1, atol=1e-4)
    with pytest.raises(TypeError, match="RewardModel"):
        reward_model_reward(rm.backbone)


def _reward_model_of_width(intermediate: int) -> RewardModel:
    """A tiny random reward model whose MLP is ``intermediate`` wide."""
    import dataclasses

    cfg = dataclasses.replace(
        tiny("qwen3_gqa_head_dim", pad_token_id=PAD), intermediate_size=intermediate
    )
    return RewardModel(
        init_reward_model(random_model(cfg, 0), head_std=0.0).backbone, jnp.ones(cfg.hidden_size)
    )


def _assert_weights_are_arguments(program) -> None:
    """``program(intermediate) -> (weights' size, lowered text)`` at MLP widths 16 and 1024 (the
    weights over 8x larger): the text does not grow (a closed-over model would embed every weight
    as a constant) and holds no constant of a weight's size."""
    import re

    (small, text), (big, big_text) = program(16), program(1024)
    assert big > 8 * small
    assert len(big_text) < 1.05 * len(text), (len(text), len(big_text))
    constants = re.findall(r"dense<\"0x([0-9A-F]+)\">", big_text)
    assert max((len(c) // 2 for c in constants), default=0) < 4 * 1024, "a weight-sized constant"


def test_reward_model_weights_are_arguments_of_the_program_not_constants():
    """The program ``score_tokens`` compiles takes the reward model's arrays as arguments."""
    import dataclasses

    from relax.rewards.token_rewards import scores_program

    def program(intermediate):
        fn = reward_model_reward(_reward_model_of_width(intermediate))
        arrays = _batch(fn.params.backbone.config.vocab_size)
        size = sum(x.size for x in jax.tree.leaves(fn.params))
        args = (arrays[0], arrays[1].astype(bool), arrays[2], arrays[3].astype(bool))
        text = scores_program.lower(
            (dataclasses.replace(fn, params=None),), "nan", (fn.params,), *args
        ).as_text()
        return size, text

    _assert_weights_are_arguments(program)


def test_text_reward_model_weights_are_arguments_not_constants():
    """``--reward-model`` in a GRPO/PPO run scores through ``TextRewardModel``: its compiled
    program takes the weights as arguments too."""
    import equinox as eqx

    from relax.rewards.model import TextRewardModel

    def program(intermediate):
        rm = _reward_model_of_width(intermediate)
        scorer = TextRewardModel(rm, tokenizer=None)  # the tokenizer only encodes texts
        ids, mask = jnp.ones((4, 16), jnp.int32), jnp.ones((4, 16), jnp.int32)
        tokens, tmask = jnp.ones((4, 1, 16), jnp.int32), jnp.ones((4, 1, 16), jnp.int32)
        size = sum(x.size for x in jax.tree.leaves(eqx.filter(rm, eqx.is_array)))
        return size, scorer._score.lower(rm, ids, mask, tokens, tmask).as_text()

    _assert_weights_are_arguments(program)


@pytest.mark.slow
def test_text_reward_model_with_its_own_tokenizer(tmp_path):
    """A reward model with another tokenizer than the policy's scores the decoded texts: each
    sample equals ``sequence_rewards`` on that sample encoded by hand (BOS + prompt, completion +
    EOS), alone; batching, padding, buckets and truncation change nothing else."""
    from text_fixtures import make_model_dir

    from relax.rewards.model import TextRewardModel
    from relax.text import load_tokenizer

    tok = load_tokenizer(make_model_dir(tmp_path, "llama3"))
    backbone = random_model(
        tiny("llama3_gqa_tied", vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id), 0
    )
    head = np.random.default_rng(1).standard_normal(backbone.config.hidden_size).astype(np.float32)
    rm = RewardModel(backbone, jnp.asarray(0.5 * head))
    prompts = ["What is two plus two?", "Name a colour.", "What is two plus two?"]
    completions = ["Four.", "", "It is 4, since two and two make four; " * 3]
    reward = TextRewardModel(rm, tok, batch_size=2, max_completion_tokens=12)
    got = reward(prompts, completions)
    assert reward.__name__ == "reward_model" and len(got) == 3
    for p, c, value in zip(prompts, completions, got):
        ids = tok.encode(p, add_special_tokens=True)
        body = tok.encode(c, add_special_tokens=False)[:11] + [tok.eos_token_id]
        assert ids[0] == tok.bos_token_id
        want = _rewards(
            rm,
            jnp.asarray([ids]),
            jnp.ones((1, len(ids)), jnp.int32),
            jnp.asarray([[body]]),
            jnp.ones((1, 1, len(body)), jnp.int32),
        )
        np.testing.assert_allclose(value, float(want[0, 0]), atol=1e-4)
    assert got[0] != got[2]
    with pytest.raises(ValueError, match="batch_size"):
        TextRewardModel(rm, tok, batch_size=0)
