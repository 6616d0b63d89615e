"""Supervised fine-tuning: the packed forward, SFT data (masks, errors, packing), loss and step."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from text_fixtures import make_model_dir

from relax.algorithms.sft import (
    SFTConfig,
    init_sft_state,
    make_sft_loss,
    make_sft_step,
    sft_batch,
    sft_examples,
    sft_rows,
)
from relax.data.files import MissingFieldError, read_records
from relax.data.supervised import (
    PackedBatch,
    SFTExample,
    encode_sft,
    pack,
    pack_plan,
    pack_rows,
    pad_examples,
    pad_rows,
    padding_fraction,
    stack_rows,
)
from relax.models import ModelConfig, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.decoder.transformer import hidden_states
from relax.models.forward.packed import packed_hidden, packed_logprobs, segment_positions
from relax.passes import Passes
from relax.text import load_tokenizer
from relax.train.optimizer import OptimizerConfig
from relax.train.update import LossContext, token_normalizers

CFG = ModelConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
CONFIGS = {
    "full": CFG,
    "sliding": ModelConfig(**{**CFG.__dict__, "sliding_window": 3}),
    # Gemma 3-like: one sliding and one full layer (kinds scanned with the layers), local RoPE
    "mixed": ModelConfig(
        **{
            **CFG.__dict__,
            "sliding_window": 3,
            "layer_types": ("sliding", "full"),
            "rope_local_theta": 100.0,
        }
    ),
}
LENGTHS = [7, 3, 5, 9, 4, 2, 6]


def _examples(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = (rng.random(n) < 0.7).astype(np.int32)
        mask[0], mask[-1] = 0, 1
        out.append(SFTExample(rng.integers(1, CFG.vocab_size, n), mask))
    return out


def _placements(plan, examples):
    """(row, offset) of every example under ``plan``."""
    where = {}
    for r, members in enumerate(plan):
        t = 0
        for i in members:
            where[i] = (r, t)
            t += len(examples[i])
    return [where[i] for i in range(len(examples))]


def _ctx(batch):
    return LossContext({k: v for k, v in token_normalizers(batch).items()}, jnp.bool_(False))


# ------------------------------------------------------------------------------ packed forward


def test_segment_positions_restart():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(
        segment_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    )


@pytest.mark.parametrize("block", [4, None], ids=["stream", "dense"])
@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.slow
def test_packed_equals_each_example_alone(kind, block):
    """Per-example log-probs and gradients of a packed batch = each example run alone, and the
    SFT loss (value, metrics, gradient) of the packed batch = that of the unpacked one; with the
    block-sparse attention (4 blocks a row) and the dense one."""
    cfg = CONFIGS[kind]
    model = init(cfg, jax.random.key(0), std=0.3)
    examples = _examples()
    row = 16
    plan = pack_plan([len(e) for e in examples], row)
    assert len(plan) < len(examples) and all(
        len(m) > 1 for m in plan[:2]
    )  # several examples per row
    packed = jax.tree.map(jnp.asarray, pack(examples, row))
    where = _placements(plan, examples)
    w = jnp.asarray(np.random.default_rng(1).normal(size=len(examples)), jnp.float32)

    def packed_nll(m):
        lp = packed_logprobs(m, packed.ids, packed.segment_ids, block=block)
        return jnp.stack(
            [
                -jnp.sum(lp[r, t : t + len(e) - 1] * e.loss_mask[1:])
                for e, (r, t) in zip(examples, where)
            ]
        )

    # each example alone in its own row (right padding is invisible to causal attention)
    alone = pad_rows(examples, max(map(len, examples)))

    def alone_nll(m):
        lp = token_logprobs(m, jnp.asarray(alone.ids), jnp.asarray(alone.segment_ids))
        return -jnp.sum(lp * alone.loss_mask[:, 1:], axis=1)

    weighted = lambda f: jax.jit(
        jax.value_and_grad(lambda m: (jnp.sum(w * f(m)), f(m)), has_aux=True)
    )  # noqa: E731
    (_, nll_packed), g_packed = weighted(packed_nll)(model)
    (_, nll_alone), g_alone = weighted(alone_nll)(model)
    np.testing.assert_allclose(nll_packed, nll_alone, rtol=1e-5, atol=1e-5)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_alone))
    chex.assert_trees_all_close(g_packed, g_alone, atol=1e-5 * scale, rtol=1e-4)

    # the SFT loss: packed rows vs one example per row (same normaliser: the same targets)
    unpacked = jax.tree.map(jnp.asarray, pad_rows(examples, row))
    assert padding_fraction(packed) < padding_fraction(unpacked)
    loss = jax.jit(jax.value_and_grad(make_sft_loss(block=block), has_aux=True))
    (l1, m1), g1 = loss(model, packed, _ctx(packed))
    (l2, m2), g2 = loss(model, unpacked, _ctx(unpacked))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(
        l1, float(jnp.sum(nll_alone)) / sum(e.loss_mask.sum() for e in examples), rtol=1e-5
    )
    np.testing.assert_allclose(m1["nll"], l1, rtol=1e-5)
    np.testing.assert_allclose(m1["accuracy"], m2["accuracy"])
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g2))
    chex.assert_trees_all_close(g1, g2, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("kind", ["full", "mixed"])
@pytest.mark.slow
def test_packed_hidden_states_restart_positions(kind):
    """Each example's hidden states in a packed row = the model on that example alone (so RoPE
    saw positions starting at 0), padding included in the row."""
    model = init(CONFIGS[kind], jax.random.key(3), std=0.3)
    examples = _examples([5, 6, 3], seed=2)
    batch = pack(examples, 16, method="greedy")
    assert batch.segment_ids.tolist() == [[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2]
    h = packed_hidden(model, jnp.asarray(batch.ids), jnp.asarray(batch.segment_ids), block=4)
    t = 0
    for e in examples:
        alone = hidden_states(model, jnp.asarray(e.ids)[None])[0]
        np.testing.assert_allclose(h[0, t : t + len(e)], alone, atol=2e-5, rtol=1e-5)
        t += len(e)


def test_loss_accuracy_is_the_argmax_rate():
    model = init(CFG, jax.random.key(4), std=0.3)
    examples = _examples([8, 6], seed=5)
    batch = jax.tree.map(jnp.asarray, pack(examples, 16))
    _, metrics = make_sft_loss(chunk_size=4)(model, batch, _ctx(batch))  # several head chunks
    hits = total = 0
    for e in examples:
        logits = model(jnp.asarray(e.ids)[None])[0, :-1]
        ok = np.asarray(jnp.argmax(logits, -1)) == e.ids[1:]
        hits += int(np.sum(ok * e.loss_mask[1:]))
        total += int(e.loss_mask[1:].sum())
    np.testing.assert_allclose(metrics["accuracy"], hits / total, rtol=1e-6)


# ------------------------------------------------------------------------------ packing


def test_pack_plans_and_padding():
    lengths = [5, 9, 3, 7, 2, 6]
    ffd = pack_plan(lengths, 10)
    assert sorted(i for m in ffd for i in m) == list(range(6))
    assert all(sum(lengths[i] for i in m) <= 10 for m in ffd)
    assert ffd == [[1], [3, 2], [5, 4], [0]]  # longest first, each into the first row with room
    assert pack_plan(lengths, 10, method="greedy") == [
        [0],
        [1],
        [2, 3],
        [4, 5],
    ]  # in order, next fit
    with pytest.raises(ValueError, match="unknown pack method"):
        pack_plan(lengths, 10, method="best")
    examples = [
        SFTExample(np.arange(1, n + 1), [0] + [1] * (n - 1), origin=f"f.jsonl: row {i + 1}")
        for i, n in enumerate(lengths)
    ]
    batch = pack(examples, 10, num_rows=5)
    assert isinstance(batch, PackedBatch)
    assert batch.ids.shape == (5, 10) and not batch.segment_ids[4].any()
    np.testing.assert_allclose(padding_fraction(batch), 1 - sum(lengths) / 50)
    assert batch.loss_mask.sum() == sum(lengths) - len(lengths)
    with pytest.raises(ValueError, match="need 4 rows of 10 tokens, more than num_rows=3"):
        pack(examples, 10, num_rows=3)
    with pytest.raises(ValueError, match=r"f.jsonl: row 2: 9 tokens do not fit a row of 8"):
        pack(examples, 8)
    with pytest.raises(ValueError, match=r"f.jsonl: row 2: 9 tokens do not fit a row of 8"):
        pad_rows(examples, 8)
    with pytest.raises(ValueError, match="first token of an example cannot be a target"):
        SFTExample([1, 2], [1, 1])
    # first-fit-decreasing (a max-tree) = the plain quadratic first fit over the sorted lengths
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        lengths = rng.integers(1, 40, n).tolist()
        rows, room = [], []
        for i in sorted(range(n), key=lambda i: -lengths[i]):
            j = next((j for j, free in enumerate(room) if free >= lengths[i]), len(rows))
            if j == len(rows):
                rows.append([])
                room.append(40)
            rows[j].append(i)
            room[j] -= lengths[i]
        assert pack_plan(lengths, 40) == rows
    # a whole dataset packed once into rows, batched by stacking rows
    rows = pack_rows(examples, 10, pad_id=0)
    assert len(rows) == 4 and rows[0].ids.shape == (1, 10)  # each a batch of one row
    chex.assert_trees_all_equal(stack_rows(rows), pack(examples, 10))
    assert len(pack_rows(examples, 10, packing=False)) == 6
    # the reverse task's prompt + response rows are unchanged
    ids, mask, loss = pad_examples([[1, 2]], [[3]], length=4, pad_id=0)
    assert (
        ids.tolist() == [[1, 2, 3, 0]]
        and mask.tolist() == [[1, 1, 1, 0]]
        and loss.tolist() == [[0, 0, 1, 0]]
    )


# ------------------------------------------------------------------------------ SFT data


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_tok")
    return {style: load_tokenizer(make_model_dir(root, style)) for style in ("qwen25", "llama3")}


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The answer is 4."},
    {"role": "user", "content": "Hello world!"},
    {"role": "assistant", "content": "Hello! This is a tiny corpus."},
]
TURN_END = {"qwen25": "<|im_end|>\n", "llama3": "<|eot_id|>"}


@pytest.mark.parametrize("style", ["qwen25", "llama3"])
def test_chat_loss_on_assistant_turns_only(toks, style):
    tok = toks[style]
    (e,) = encode_sft([{"messages": CHAT}], tok, max_length=512)
    assert e.ids.tolist() == tok.apply_chat_template(CHAT)
    targets = np.flatnonzero(e.loss_mask)
    runs = np.split(
        targets, np.flatnonzero(np.diff(targets) > 1) + 1
    )  # one run of targets per turn
    assert [tok.decode(e.ids[r]) for r in runs] == [
        m["content"] + TURN_END[style] for m in CHAT if m["role"] == "assistant"
    ]
    # the header of each assistant turn is not a target: it is what the generation prompt writes
    before = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True)
    assert runs[0][0] == len(before)
    # a prompt given as messages, with a string completion: the same tokens and targets as the chat
    (pc,) = encode_sft(
        [{"prompt": CHAT[:2], "completion": "The answer is 4."}], tok, max_length=512
    )
    (chat,) = encode_sft([{"messages": CHAT[:3]}], tok, max_length=512)
    assert pc.ids.tolist() == chat.ids.tolist() and pc.loss_mask.tolist() == chat.loss_mask.tolist()


def test_prompt_completion_and_text_masks(toks):
    tok = toks["llama3"]  # encode adds a BOS
    eos = tok.eos_token_id
    (pc,) = encode_sft(
        [{"prompt": "What is 2 + 2?", "completion": " The answer is 4."}], tok, max_length=64
    )
    p = tok.encode("What is 2 + 2?")
    c = tok.encode(" The answer is 4.", add_special_tokens=False) + [eos]
    assert pc.ids.tolist() == p + c and pc.loss_mask.tolist() == [0] * len(p) + [1] * len(c)
    (tx,) = encode_sft([{"text": "Hello world!"}], tok, max_length=64)
    assert tx.ids.tolist() == tok.encode("Hello world!") + [eos]
    assert tx.loss_mask.tolist() == [0] + [1] * (len(tx.ids) - 1)
    # truncation cuts from the end and keeps the start
    (cut,) = encode_sft(
        [{"text": "Hello world! This is a tiny corpus."}], tok, max_length=4, truncate=True
    )
    assert cut.ids.tolist() == tok.encode("Hello world! This is a tiny corpus.")[:4]


def _jsonl(tmp_path, rows):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_records(path)


@pytest.mark.parametrize(
    "row, error, message",
    [
        ({"prompt": "hi"}, MissingFieldError, r"sft.jsonl: row 1: missing field 'completion'"),
        (
            {"answer": "hi"},
            MissingFieldError,
            r"sft.jsonl: row 1: missing field: a supervised row needs 'messages', "
            r"'prompt' \+ 'completion', or 'text'",
        ),
        (
            {"prompt": "hi", "completion": ""},
            ValueError,
            r"sft.jsonl: row 1: field 'completion': is empty",
        ),
        (
            {"prompt": CHAT[:2], "completion": []},
            ValueError,
            r"sft.jsonl: row 1: field 'completion': is empty",
        ),
        ({"text": ""}, ValueError, r"sft.jsonl: row 1: field 'text': is empty"),
        (
            {"messages": CHAT[:2]},
            ValueError,
            r"sft.jsonl: row 1: field 'messages': has no assistant message",
        ),
        (
            {"messages": "hi"},
            ValueError,
            r"sft.jsonl: row 1: field 'messages': expected a list of chat messages",
        ),
        (
            {"text": "Hello world! " * 20},
            ValueError,
            r"sft.jsonl: row 1: field 'text': the example has \d+ tokens > max_length=16 \(pass truncate=True",
        ),
        (
            {"prompt": "hi " * 20, "completion": "ok"},
            ValueError,
            r"sft.jsonl: row 1: field 'prompt': the example has",
        ),
        (
            {"messages": CHAT},
            ValueError,
            r"sft.jsonl: row 1: field 'messages': the example has \d+ tokens > max_length",
        ),
    ],
)
def test_bad_rows_name_the_file_row_and_field(tmp_path, toks, row, error, message):
    records = _jsonl(tmp_path, [row])
    with pytest.raises(error, match=message):
        encode_sft(records, toks["qwen25"], max_length=16)


def test_truncation_must_keep_a_target(tmp_path, toks):
    records = _jsonl(
        tmp_path, [{"text": "Hello world!"}, {"prompt": "hi " * 20, "completion": "ok"}]
    )
    with pytest.raises(
        ValueError,
        match=r"sft.jsonl: row 2: field 'prompt': cut to max_length=8 tokens, the "
        r"example keeps no loss token",
    ):
        encode_sft(records, toks["qwen25"], max_length=8, truncate=True)
    d = make_model_dir(tmp_path, "qwen25")
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"<records>: row 1: field 'messages': chat messages need a chat template"
    ):
        encode_sft([{"messages": CHAT}], load_tokenizer(d), max_length=512)


# ------------------------------------------------------------------------------ step


@pytest.mark.slow
def test_sft_step_grad_accumulation_is_invisible():
    """grad_accum 1 vs 2 (3 rows: the step pads to 4; and layers recomputed in the backward):
    the same update, loss and metrics."""
    model = init(CFG, jax.random.key(5), std=0.3)
    examples = _examples([9, 7, 5, 4, 3, 8], seed=7)
    # eps=1: Adam's first step ~ lr * g, so the comparison is of gradients, not of their signs
    opt = OptimizerConfig(learning_rate=0.1, eps=1.0)
    results = []
    for accum in (1, 2):
        cfg = SFTConfig(max_length=12, grad_accum=accum, remat=accum == 2, optimizer=opt)
        batch = sft_batch(cfg, examples, pad_id=0)
        assert batch.ids.shape[0] == 3
        state = init_sft_state(
            cfg, jax.tree.map(jnp.copy, model), key=jax.random.key(0)
        )  # the step donates it
        state, out = make_sft_step(cfg, Passes())(state, batch)
        results.append((state, out))
    (s1, o1), (s2, o2) = results
    assert int(s1.step) == int(s2.step) == 1
    chex.assert_trees_all_close(s1.policy, s2.policy, atol=1e-6, rtol=1e-5)
    for k in ("loss", "nll", "accuracy", "grad_norm"):
        np.testing.assert_allclose(o1.metrics[k], o2.metrics[k], rtol=1e-5, err_msg=k)
    assert int(o1.metrics["tokens"]) == sum(len(e) for e in examples)
    assert int(o1.metrics["loss_tokens"]) == sum(int(e.loss_mask.sum()) for e in examples)
    np.testing.assert_allclose(o1.metrics["padding_fraction"], 1 - 36 / 36)
    np.testing.assert_allclose(o2.metrics["padding_fraction"], 1 - 36 / 48)  # the empty 4th row
    assert {k: int(v) for k, v in o1.health.items()} == {
        "first_nonfinite_grad": -1,
        "first_nonfinite": -1,
        "consecutive_skips": 0,
    }
    assert not np.array_equal(s1.policy.embed, model.embed)


@pytest.mark.slow
def test_sft_step_trains_and_reports_nonfinite(toks):
    tok = toks["qwen25"]
    cfg = SFTConfig(max_length=48, packing=False, optimizer=OptimizerConfig(learning_rate=3e-2))
    examples = sft_examples(
        cfg,
        [{"prompt": "What is 2 + 2?", "completion": " The answer is 4."}, {"text": "Hello world!"}],
        tok,
    )
    batch = sft_batch(cfg, examples, pad_id=tok.pad_token_id)
    assert batch.ids.shape == (2, 48) and batch.segment_ids.max() == 1
    stacked = stack_rows(sft_rows(cfg, examples, pad_id=tok.pad_token_id))
    chex.assert_trees_all_equal(stacked, batch)
    model = init(ModelConfig(**{**CFG.__dict__, "vocab_size": tok.vocab_size}), jax.random.key(0))
    state = init_sft_state(cfg, model, key=jax.random.key(1))
    step = make_sft_step(cfg)
    losses = []
    for _ in range(5):
        state, out = step(state, batch)
        losses.append(float(out.metrics["loss"]))
    assert losses[-1] < losses[0]
    bad = state.replace(
        policy=jax.tree.map(lambda x: x * jnp.nan if x.ndim == 2 else x, state.policy)
    )
    bad, out = step(bad, batch)
    assert int(out.health["first_nonfinite"]) == 4 and int(out.health["consecutive_skips"]) == 1
    assert int(out.health["first_nonfinite_grad"]) >= 0
