"""DPO family: pair data, the shared-prompt forward, SimPO/DPO losses, the step, the reference cache."""

import dataclasses
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from text_fixtures import make_model_dir

from relax.algorithms.dpo import (
    DPOConfig,
    evaluate,
    make_dpo_eval,
    make_dpo_loss,
    make_dpo_step,
    make_state,
    pair_normalizers,
)
from relax.algorithms.dpo.step import collate, encode
from relax.algorithms.preference import reference_cache as rc
from relax.algorithms.preference.pairs import PairRows, sequence_logps, shared_forward
from relax.data.files import MissingFieldError, read_records
from relax.data.pairs import Pair, PairBatch, collate_pairs, encode_pairs, with_reference
from relax.models import ModelConfig, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.prefix_shared import completion_rope
from relax.objectives.preference import simpo_loss
from relax.passes import Passes
from relax.text import load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece
from relax.train.health import QUANTITIES
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state
from relax.train.update import make_update

CFG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
P, LP, N = 4, 6, 5


def logsig(x):
    return -np.logaddexp(0.0, -x)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """Chat tokenizers: Qwen2.5 (no BOS; the template ends turns with ``<|im_end|>\\n``) and Llama 3
    (``encode`` adds a BOS; turns end with ``<|eot_id|>``, one of its eos ids)."""
    root = tmp_path_factory.mktemp("hf")
    return {style: load_tokenizer(make_model_dir(root, style)) for style in ("qwen25", "llama3")}


def _batch(seed=0, p=P):
    """Random pairs: left-padded prompts of different lengths, right-padded completions."""
    rng = np.random.default_rng(seed)
    ids, pm = np.zeros((p, LP), np.int32), np.zeros((p, LP), np.int32)
    for i in range(p):
        n = [6, 3, 4, 2, 5, 1, 6, 2][i % 8]
        ids[i, LP - n :] = rng.integers(1, CFG.vocab_size, n)
        pm[i, LP - n :] = 1
    tokens = rng.integers(1, CFG.vocab_size, (p, 2, N)).astype(np.int32)
    mask = np.ones((p, 2, N), np.int32)
    mask[0, 1, 3:] = 0
    mask[2, 0, 2:] = 0
    mask[p - 1, 1, 1:] = 0
    return PairBatch(
        prompt_ids=ids, prompt_mask=pm, tokens=tokens, mask=mask, loss_mask=np.ones(p, np.int32)
    )


def _models():
    policy = init(CFG, jax.random.key(0), std=0.3)
    ref = jax.tree.map(
        lambda x: (
            x + 0.05 * jax.random.normal(jax.random.key(3), x.shape, x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        policy,
    )
    return policy, ref


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def full_sequence_logps(model, b):
    """``[P, 2]`` sums from two separate full-sequence forwards, [prompt; chosen] and [prompt; rejected]."""
    out = []
    for j in range(2):
        full = np.concatenate([b.prompt_ids, b.tokens[:, j]], 1)
        fmask = np.concatenate([b.prompt_mask, b.mask[:, j]], 1)
        lp = np.asarray(token_logprobs(model, jnp.asarray(full), jnp.asarray(fmask)))[:, LP - 1 :]
        out.append(np.sum(np.where(b.mask[:, j] > 0, lp, 0.0), -1))
    return np.stack(out, -1)


# ----------------------------------------------------------------------------- losses


def np_simpo(c, r, beta, gamma, e):
    z = beta * (c - r) - gamma
    return -(1 - e) * logsig(z) - e * logsig(-z)


@pytest.mark.parametrize("e", [0.0, 0.2])
def test_simpo_against_numpy_hand_values_and_grad(e):
    rng = np.random.default_rng(0)
    c, r = (rng.uniform(-3, -0.1, 6).astype(np.float32) for _ in range(2))
    losses, m = jax.jit(lambda c, r: simpo_loss(c, r, beta=2.0, gamma=0.5, label_smoothing=e))(c, r)
    np.testing.assert_allclose(
        losses, np_simpo(c.astype(np.float64), r, 2.0, 0.5, e), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(m["rewards/chosen"], 2.0 * c, rtol=1e-6)
    np.testing.assert_allclose(m["rewards/margins"], 2.0 * (c - r), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(m["rewards/accuracies"], (c > r).astype(np.float32))
    # hand: c = r -> -log s(-gamma) = log(1 + e^gamma); beta (c - r) = gamma -> log 2
    zero = np.zeros(1, np.float32)
    assert float(simpo_loss(zero, zero, beta=2.0, gamma=0.5)[0][0]) == pytest.approx(
        math.log1p(math.exp(0.5))
    )
    assert float(
        simpo_loss(np.array([0.25], np.float32), zero, beta=2.0, gamma=0.5)[0][0]
    ) == pytest.approx(math.log(2))
    g = jax.grad(lambda c: jnp.sum(simpo_loss(c, r, beta=2.0, gamma=0.5, label_smoothing=e)[0]))(c)
    z = 2.0 * (c - r) - 0.5  # d/dc = -beta ((1 - e) s(-z) - e s(z))
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    np.testing.assert_allclose(g, -2.0 * ((1 - e) * sig(-z) - e * sig(z)), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(c, r, beta=0.0, gamma=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(c, r, beta=1.0, gamma=0.5, label_smoothing=0.6)


def test_config_checks():
    assert DPOConfig().needs_reference and not DPOConfig(precompute_reference=True).needs_reference
    assert (
        not DPOConfig(loss_type="simpo").uses_reference
        and not DPOConfig(loss_type="orpo").needs_reference
    )
    with pytest.raises(ValueError, match="unknown loss_type 'kto'"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing is not used by loss_type='ipo'"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\) for robust"):
        DPOConfig(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="uses no reference model"):
        DPOConfig(loss_type="orpo", precompute_reference=True)
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        DPOConfig(grad_accum=0)


# ----------------------------------------------------------------------------- pair data


def test_standard_and_conversational_pairs(toks):
    llama, qwen = toks["llama3"], toks["qwen25"]
    # standard rows: raw text; the prompt gets what encode adds (Llama 3: a BOS), completions an EOS
    [p] = encode_pairs(
        [{"prompt": "Hello world!", "chosen": " sunny", "rejected": " rainy"}],
        llama,
        max_prompt_tokens=16,
        max_completion_tokens=8,
    )
    assert p.prompt == llama.encode("Hello world!") and p.prompt[0] == llama.bos_token_id
    assert p.chosen == llama.encode(" sunny", add_special_tokens=False) + [llama.eos_token_id]
    assert p.rejected == llama.encode(" rainy", add_special_tokens=False) + [llama.eos_token_id]
    assert (p.file, p.row) == ("<records>", 1)
    # conversational: prompt through the template with the generation prompt, completions as the
    # assistant turn; Qwen's "<|im_end|>\n" is cut after <|im_end|> (an eos id), nothing appended
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = [
        {
            "prompt": msgs,
            "chosen": [{"role": "assistant", "content": "The answer is 4."}],
            "rejected": "It is 5.",
        }
    ]
    [q] = encode_pairs(rows, qwen, max_prompt_tokens=64, max_completion_tokens=16)
    assert q.prompt == qwen.apply_chat_template(msgs, add_generation_prompt=True)
    assert (
        qwen.decode(q.chosen) == "The answer is 4.<|im_end|>"
        and qwen.decode(q.rejected) == "It is 5.<|im_end|>"
    )
    # Llama 3's turn ends with <|eot_id|>: kept as the EOS; a string prompt is one user message
    [r] = encode_pairs(
        [
            {
                "prompt": "What is 2 + 2?",
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": "5",
            }
        ],
        llama,
        max_prompt_tokens=128,
        max_completion_tokens=8,
    )
    assert r.prompt == llama.apply_chat_template(msgs, add_generation_prompt=True)
    assert llama.decode(r.chosen) == "4<|eot_id|>" and r.chosen.count(llama.bos_token_id) == 0
    # implicit prompt: whole conversations sharing their first messages
    conv = lambda answer: msgs + [{"role": "assistant", "content": answer}]  # noqa: E731
    [s] = encode_pairs(
        [{"chosen": conv("The answer is 4."), "rejected": conv("It is 5.")}],
        qwen,
        max_prompt_tokens=64,
        max_completion_tokens=16,
    )
    assert (s.prompt, s.chosen, s.rejected) == (q.prompt, q.chosen, q.rejected)


def test_collate_layout_and_reference_entries():
    pairs = [Pair([5, 6, 7], [1, 2], [3], "f", 1), Pair([8], [4, 4, 4], [9, 9], "f", 2)]
    b = collate_pairs(pairs, pad_id=0, prompt_length=4, completion_length=3)
    assert isinstance(b, PairBatch)
    np.testing.assert_array_equal(b.prompt_ids, [[0, 5, 6, 7], [0, 0, 0, 8]])
    np.testing.assert_array_equal(b.prompt_mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(b.tokens, [[[1, 2, 0], [3, 0, 0]], [[4, 4, 4], [9, 9, 0]]])
    np.testing.assert_array_equal(b.mask, [[[1, 1, 0], [1, 0, 0]], [[1, 1, 1], [1, 1, 0]]])
    np.testing.assert_array_equal(b.loss_mask, [1, 1])
    assert b.ref_logps is None
    b = collate_pairs(
        with_reference(pairs, [[-1.0, -2.0], [-3.0, -4.0]]),
        pad_id=0,
        prompt_length=4,
        completion_length=3,
    )
    np.testing.assert_array_equal(b.ref_logps[:, 0], [-1, -3])  # chosen
    np.testing.assert_array_equal(b.ref_logps[:, 1], [-2, -4])  # rejected
    with pytest.raises(ValueError, match="do not match 2 examples"):
        with_reference(pairs, np.zeros((3, 2)))
    with pytest.raises(ValueError, match="3 tokens > the batch's completion length 2"):
        collate_pairs(pairs, pad_id=0, prompt_length=4, completion_length=2)


def test_bad_rows_name_file_row_and_field(tmp_path, toks):
    llama, qwen = toks["llama3"], toks["qwen25"]
    good = {"prompt": "Hello world!", "chosen": " sunny", "rejected": " rainy"}

    def check(row, match, tok=llama, error=ValueError, **kw):
        f = tmp_path / "pairs.jsonl"
        f.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")  # the bad row is line 3
        kw = {"max_prompt_tokens": 16, "max_completion_tokens": 8, **kw}
        with pytest.raises(error, match=rf"{f}: (line|row) 3: .*{match}"):
            encode_pairs(read_records(f), tok, **kw)

    check({"prompt": "Hi", "chosen": " a"}, r"missing field 'rejected'", error=MissingFieldError)
    check({"prompt": "Hi", "rejected": " a"}, r"missing field 'chosen'", error=MissingFieldError)
    check({"chosen": " a", "rejected": " b"}, r"missing field 'prompt'", error=MissingFieldError)
    check({**good, "chosen": ""}, r"field 'chosen': is empty")
    check({**good, "rejected": "  \n"}, r"field 'rejected': is empty")
    check(
        {**good, "chosen": [{"role": "assistant", "content": ""}]},
        r"field 'chosen': is empty",
        tok=qwen,
        max_prompt_tokens=64,
    )
    check({**good, "prompt": ""}, r"field 'prompt': is empty", tok=qwen)
    check(
        {**good, "chosen": 3},
        r"field 'chosen': must be a string or a list of chat messages, got int",
    )
    check(
        {**good, "prompt": [{"content": "x"}]},
        r"field 'prompt': chat messages must be dicts with a 'role'",
    )
    check(
        {**good, "prompt": "word " * 40},
        r"field 'prompt': has \d+ tokens > max_prompt_tokens=16 "
        r"\(truncate_prompt is off\)",
    )
    check(
        {**good, "rejected": " rainy" * 20},
        r"field 'rejected': has \d+ tokens with its EOS > "
        r"max_completion_tokens=8",
    )
    # overlong completions are an error even with prompt truncation on
    check(
        {**good, "chosen": " sunny" * 20}, r"field 'chosen': has \d+ tokens", truncate_prompt=True
    )
    check(
        {
            "chosen": [{"role": "user", "content": "a"}],
            "rejected": [{"role": "user", "content": "b"}],
        },
        r"field 'chosen': no prompt column, and 'chosen' and 'rejected' share no first message",
        tok=qwen,
    )
    texts = [f"question {i}: what is {i} plus {2 * i} ? say the answer" for i in range(300)]
    spm = load_tokenizer(
        train_sentencepiece(texts, tmp_path / "tiny", vocab_size=100)
    )  # no chat template
    check(
        {**good, "prompt": [{"role": "user", "content": "x"}]},
        r"field 'prompt': chat messages need a chat "
        "template",
        tok=spm,
    )


def test_prompt_truncation_keeps_the_bos_and_the_end(toks):
    llama = toks["llama3"]
    text = " ".join(f"word{i}" for i in range(30))
    ids = llama.encode(text)
    [p] = encode_pairs(
        [{"prompt": text, "chosen": " a", "rejected": " b"}],
        llama,
        max_prompt_tokens=10,
        max_completion_tokens=8,
        truncate_prompt=True,
    )
    assert len(ids) > 10 and p.prompt == [llama.bos_token_id] + ids[-9:]


# ----------------------------------------------------------------------------- the forward


@pytest.mark.slow
def test_shared_prompt_logps_equal_two_full_sequence_forwards():
    policy, _ = _models()
    b = _batch()
    want = full_sequence_logps(policy, b)
    jb = jax.tree.map(jnp.asarray, b)
    for passes in (Passes(), Passes(cache_sized=True)):  # one pass / one prompt per pass, unrolled
        for train in (False, True):
            rope = completion_rope(CFG, jb.prompt_mask, 2, N) if train else None
            mb = PairRows(
                prompt_ids=jb.prompt_ids,
                prompt_mask=jb.prompt_mask,
                tokens=jb.tokens,
                mask=jb.mask,
                loss_mask=jb.loss_mask,
                rope=rope,
            )
            got, lengths = sequence_logps(shared_forward(passes)(policy, mb, train), jb.mask)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lengths, b.mask.sum(-1))


# ----------------------------------------------------------------------------- the step


def _state(cfg, policy, ref=None):
    return init_state(
        _copy(policy), cfg.optimizer.make(), key=jax.random.key(1), with_reference=False
    ).replace(ref=None if ref is None else _copy(ref))


@pytest.mark.slow
def test_policy_equal_to_reference_gives_log2_and_zero_margins():
    policy, _ = _models()
    cfg = DPOConfig(optimizer=OptimizerConfig(learning_rate=1e-3))
    state = init_state(
        _copy(policy), cfg.optimizer.make(), key=jax.random.key(1), with_reference=True
    )
    state, out = make_dpo_step(cfg)(state, _batch())
    m = out.metrics
    assert float(m["loss"]) == pytest.approx(math.log(2), abs=1e-7)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert float(m[k]) == 0.0, k
    assert bool(out.batch.ref_is_policy) and float(m["grad_norm"]) > 0
    assert {k: int(v) for k, v in out.health.items()} == {
        "first_nonfinite_grad": -1,
        "first_nonfinite": -1,
        "consecutive_skips": 0,
    }
    assert int(state.step) == 1
    want = full_sequence_logps(policy, _batch())
    np.testing.assert_allclose(m["logps/chosen"], want[:, 0].mean(), rtol=1e-5)
    # the weights moved: the next step compares with the reference, margins no longer 0
    _, out = make_dpo_step(cfg)(state, _batch())
    assert not bool(out.batch.ref_is_policy) and float(out.metrics["rewards/margins"]) != 0.0


def np_dpo_loss(pol, ref, lengths, cfg):
    if cfg.loss_type == "simpo":
        m = pol / lengths
        return np_simpo(m[:, 0], m[:, 1], cfg.beta, cfg.simpo_gamma, cfg.label_smoothing).mean()
    if cfg.loss_type == "orpo":
        m = pol / lengths
        log_odds = (m[:, 0] - m[:, 1]) - (np.log1p(-np.exp(m[:, 0])) - np.log1p(-np.exp(m[:, 1])))
        return -pol[:, 0].sum() / lengths[:, 0].sum() - cfg.orpo_lambda * logsig(log_odds).mean()
    if cfg.loss_type == "ipo":
        pol, ref = pol / lengths, ref / lengths
    z = (pol[:, 0] - pol[:, 1]) - (ref[:, 0] - ref[:, 1])
    e, beta = cfg.label_smoothing, cfg.beta
    per = {
        "sigmoid": lambda: -(1 - e) * logsig(beta * z) - e * logsig(-beta * z),
        "robust": lambda: (-(1 - e) * logsig(beta * z) + e * logsig(-beta * z)) / (1 - 2 * e),
        "hinge": lambda: np.maximum(0.0, 1 - beta * z),
        "ipo": lambda: (z - 1 / (2 * beta)) ** 2,
    }[cfg.loss_type]()
    return per.mean()


@pytest.mark.parametrize(
    "cfg",
    [
        DPOConfig(),
        DPOConfig(loss_type="sigmoid", label_smoothing=0.1),
        DPOConfig(loss_type="robust", label_smoothing=0.2),
        DPOConfig(loss_type="hinge", beta=0.5),
        DPOConfig(loss_type="ipo"),
        DPOConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.3),
        DPOConfig(loss_type="orpo", orpo_lambda=0.2),
    ],
    ids=lambda c: f"{c.loss_type}-{c.label_smoothing}",
)
@pytest.mark.slow
def test_step_loss_against_numpy_on_full_sequence_logps(cfg):
    policy, ref = _models()
    b = _batch()
    pol, ref_lp = full_sequence_logps(policy, b), full_sequence_logps(ref, b)
    lengths = b.mask.sum(-1).astype(np.float64)
    state = _state(cfg, policy, ref if cfg.uses_reference else None)
    _, out = make_dpo_step(cfg)(state, b)
    m = out.metrics
    np.testing.assert_allclose(
        m["loss"], np_dpo_loss(pol, ref_lp, lengths, cfg), rtol=2e-5, atol=1e-5
    )
    if cfg.uses_reference:
        np.testing.assert_allclose(out.batch.ref_logps[:, 0], ref_lp[:, 0], rtol=1e-5)
        scale = 1 / lengths if cfg.loss_type == "ipo" else 1.0
        chosen = cfg.beta * ((pol - ref_lp) * scale)[:, 0]
        np.testing.assert_allclose(m["rewards/chosen"], chosen.mean(), rtol=1e-4, atol=1e-6)
    if cfg.loss_type == "orpo":
        np.testing.assert_allclose(m["nll"], -pol[:, 0].sum() / lengths[:, 0].sum(), rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", pytest.param("orpo", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_grad_accumulation_changes_nothing(loss_type):
    """The loss divides by the whole batch's pairs (and, for ORPO's NLL, chosen tokens): the summed
    micro-batch gradients are the batch gradient. SGD, so the update IS the gradient."""
    policy, ref = _models()
    cfg = DPOConfig(loss_type=loss_type)
    jb = jax.tree.map(jnp.asarray, _batch(p=4))
    b = PairRows(
        prompt_ids=jb.prompt_ids,
        prompt_mask=jb.prompt_mask,
        tokens=jb.tokens,
        mask=jb.mask,
        loss_mask=jb.loss_mask,
        ref_logps=jnp.asarray(full_sequence_logps(ref, _batch(p=4)), jnp.float32),
        rope=completion_rope(CFG, jb.prompt_mask, 2, N),
    )
    opt = optax.sgd(1.0)
    outs = []
    for a in (1, 2, 4):
        update = make_update(
            make_dpo_loss(cfg, Passes()), opt, grad_accum=a, normalizers=pair_normalizers
        )
        params, _, metrics = jax.jit(update)(policy, opt.init(policy), b, jax.random.key(0))
        outs.append((params, metrics))
    for params, metrics in outs[1:]:
        chex.assert_trees_all_close(params, outs[0][0], atol=2e-6, rtol=1e-5)
        for k in outs[0][1]:
            np.testing.assert_allclose(metrics[k], outs[0][1][k], rtol=1e-5, atol=1e-6, err_msg=k)
    # and the step's own configuration path: grad_accum 1 vs 2
    steps = [make_dpo_step(DPOConfig(loss_type=loss_type, grad_accum=a)) for a in (1, 2)]
    res = [s(_state(cfg, policy, ref if cfg.uses_reference else None), _batch()) for s in steps]
    chex.assert_trees_all_close(res[0][0].policy, res[1][0].policy, atol=1e-6)
    for k in ("loss", "grad_norm", "rewards/margins"):
        np.testing.assert_allclose(res[0][1].metrics[k], res[1][1].metrics[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_nonfinite_reference_is_reported_and_the_step_skipped():
    policy, _ = _models()
    cfg = DPOConfig(precompute_reference=True)
    ref_logps = np.stack(
        [np.full(P, -3.0, np.float32), np.full(P, -4.0, np.float32)], -1
    )  # chosen, rejected
    ref_logps[1, 0] = np.nan
    b = dataclasses.replace(_batch(), ref_logps=ref_logps)
    state = _state(cfg, policy)
    new, out = make_dpo_step(cfg)(state, b)
    assert int(out.health["first_nonfinite"]) == QUANTITIES.index("ref_logprobs")
    assert (
        int(out.health["consecutive_skips"]) == 1 and int(out.health["first_nonfinite_grad"]) >= 0
    )
    chex.assert_trees_all_equal(new.policy, policy)
    with pytest.raises(KeyError, match="precompute_reference=True but the batch has no ref_logps"):
        make_dpo_step(cfg)(_state(cfg, policy), _batch())
    with pytest.raises(ValueError, match="needs a reference model, and state.ref is None"):
        make_dpo_step(DPOConfig())(_state(cfg, policy), _batch())


# ----------------------------------------------------------------------------- reference cache


@pytest.mark.slow
def test_reference_cache_equals_recomputed_and_is_keyed(tmp_path, toks):
    tok = toks["qwen25"]
    cfg_m = ModelConfig(**{**CFG.__dict__, "vocab_size": tok.vocab_size})
    policy = init(cfg_m, jax.random.key(0), std=0.3)
    ref = jax.tree.map(lambda x: x * 1.1 if jnp.issubdtype(x.dtype, jnp.floating) else x, policy)
    rows = [
        {
            "prompt": f"question {i}: what is {i} plus {i}?",
            "chosen": f" {2 * i}",
            "rejected": f" {2 * i + 1}",
        }
        for i in range(5)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DPOConfig(max_prompt_tokens=24, max_completion_tokens=6, precompute_reference=True)
    pairs = encode(cfg, read_records(data), tok)
    kw = dict(batch_size=2, pad_id=tok.pad_token_id, prompt_length=24, completion_length=6)
    logps, status = rc.cached_reference_logps(ref, pairs, data, **kw)
    path = rc.default_cache_path(data, "pairs")
    assert (
        status == "computed"
        and path == tmp_path / "pairs.jsonl.pairs-reference.safetensors"
        and path.exists()
    )
    # equal to the recomputed step reference (a forward of state.ref over the same batch)
    full = collate(cfg, pairs, tok.pad_token_id)
    step_ref = DPOConfig(max_prompt_tokens=24, max_completion_tokens=6)
    _, out = make_dpo_step(step_ref)(_state(step_ref, policy, ref), full)
    np.testing.assert_allclose(logps[:, 0], out.batch.ref_logps[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logps[:, 1], out.batch.ref_logps[:, 1], rtol=1e-5, atol=1e-5)
    # the cached reference in the batch gives the same step as the reference model
    cached_batch = collate(cfg, with_reference(pairs, logps), tok.pad_token_id)
    _, cached_out = make_dpo_step(cfg)(_state(cfg, policy), cached_batch)
    for k in ("loss", "grad_norm", "rewards/margins"):
        np.testing.assert_allclose(cached_out.metrics[k], out.metrics[k], rtol=1e-5, atol=1e-6)
    # loaded back as saved; a changed data file, model or tokenization is never silently reused
    again, status = rc.cached_reference_logps(ref, pairs, data, **kw)
    assert status == "loaded"
    np.testing.assert_array_equal(again, logps)
    key = rc.cache_key(data, pairs, ref)
    with pytest.raises(rc.StaleCacheError, match="is stale: the reference model changed"):
        rc.load_cache(path, rc.cache_key(data, pairs, policy))
    short = encode(
        DPOConfig(max_prompt_tokens=24, max_completion_tokens=6, truncate_prompt=True),
        read_records(data),
        tok,
    )
    assert (
        rc.load_cache(path, rc.cache_key(data, short, ref)) is not None
    )  # same tokens: still valid
    data.write_text(data.read_text().replace("question 4", "question 9"))
    with pytest.raises(
        rc.StaleCacheError, match="is stale: the data file and the tokenized examples .* changed"
    ):
        rc.load_cache(path, rc.cache_key(data, encode(cfg, read_records(data), tok), ref))
    _, status = rc.cached_reference_logps(ref, encode(cfg, read_records(data), tok), data, **kw)
    assert status.startswith("recomputed: reference cache") and "data file" in status
    assert key["kind"] == "pairs" and key["n"] == "5"


def test_eval_stage_reports_the_loss_without_updating():
    policy, ref = _models()
    cfg = DPOConfig()
    state = _state(cfg, policy, ref)
    same, out = make_dpo_eval(cfg)(state, _batch())
    assert same is state
    want = np_dpo_loss(
        full_sequence_logps(policy, _batch()),
        full_sequence_logps(ref, _batch()),
        _batch().mask.sum(-1),
        cfg,
    )
    np.testing.assert_allclose(out.metrics["loss"], want, rtol=2e-5)


def _pairs_of(b):
    """The ``Pair``s a collated batch holds (padding stripped)."""
    pm, m = b.prompt_mask > 0, b.mask > 0
    return [
        Pair(
            list(b.prompt_ids[i][pm[i]]),
            list(b.tokens[i, 0][m[i, 0]]),
            list(b.tokens[i, 1][m[i, 1]]),
            "<records>",
            i + 1,
        )
        for i in range(len(pm))
    ]


def test_evaluate_in_padded_batches_equals_one_batch():
    policy, ref = _models()
    cfg = DPOConfig(max_prompt_tokens=LP, max_completion_tokens=N)
    state = _state(cfg, policy, ref)
    _, whole = make_dpo_eval(cfg)(state, _batch())
    got = evaluate(
        cfg, state, _pairs_of(_batch()), pad_id=0, batch_size=3
    )  # 3 + 1 real pairs (2 padding rows)
    assert set(got) == set(whole.metrics)
    for k, v in whole.metrics.items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    fresh = make_state(cfg, _copy(policy), jax.random.key(0))
    assert fresh.ref is not None
    assert make_state(DPOConfig(loss_type="simpo"), _copy(policy), jax.random.key(0)).ref is None
