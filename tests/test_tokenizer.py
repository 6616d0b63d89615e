"""Tests for relax.text.sentencepiece_model: a tiny sentencepiece model is trained once from generated text."""

import pickle
import random

import numpy as np
import pytest

from relax.text.sentencepiece_model import (
    Tokenizer,
    pad_left,
    train_sentencepiece,
)

WORDS = "the quick brown fox jumps over lazy dog what is plus minus times answer".split()


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(f"{words}: {a} {op} {b} = ?\n<|user|>\n{words.upper()}")
    return lines


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "tiny"
    return train_sentencepiece(
        _corpus(), prefix, vocab_size=96, user_defined_symbols=["<|user|>", "<|assistant|>"]
    )


@pytest.fixture(scope="session")
def tok(model_path):
    return Tokenizer.load(model_path)


def test_train_returns_model_file(model_path, tok):
    assert model_path.suffix == ".model" and model_path.is_file()
    assert 40 <= tok.vocab_size <= 96


def test_special_ids(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox",
        "what is 12 + 7 = ?",
        "  leading and  double spaces ",
        "line one\nline two",
        "<|user|>\nTHE LAZY DOG",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in ids)
    assert tok.decode(ids) == text


def test_bos_eos_added_and_stripped(tok):
    plain = tok.encode("fox 42")
    both = tok.encode("fox 42", add_bos=True, add_eos=True)
    assert both == [tok.bos_id, *plain, tok.eos_id]
    assert tok.decode(both) == "fox 42"
    # decoding stops at eos and drops pads (leading, trailing, after eos)
    ids = [tok.pad_id, tok.pad_id, *plain, tok.eos_id, *tok.encode("dog"), tok.pad_id]
    assert tok.decode(ids) == "fox 42"
    assert tok.decode(both, skip_special=False) == "<s>fox 42</s>"


def test_user_defined_symbol_is_one_piece(tok):
    ids = tok.encode("<|user|>")
    assert tok.decode(ids[-1:]) == "<|user|>"


def test_encode_batch_matches_encode(tok):
    texts = ["the dog", "1 + 2 = ?", "over lazy fox jumps"]
    assert tok.encode_batch(texts, add_bos=True) == [tok.encode(t, add_bos=True) for t in texts]


def test_pad_left_to_default_bucket():
    ids, mask = pad_left([[5, 6, 7], [8]], pad_id=0)
    expected = np.zeros((2, 16), np.int32)
    expected[0, -3:] = [5, 6, 7]
    expected[1, -1:] = [8]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(mask, (expected != 0).astype(np.int32))
    assert ids.dtype == np.int32 and mask.dtype == np.int32


def test_pad_left_picks_smallest_bucket(tok):
    ids, mask = tok.pad_left([[9] * 5, [4, 5]], bucket_sizes=(8, 4, 32))
    np.testing.assert_array_equal(ids, [[0, 0, 0, 9, 9, 9, 9, 9], [0, 0, 0, 0, 0, 0, 4, 5]])
    np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
    ids, _ = pad_left([[1] * 17], pad_id=0)
    assert ids.shape == (1, 32)


def test_pad_left_explicit_length_and_pad_id():
    ids, mask = pad_left([[1, 2]], pad_id=3, length=4)
    np.testing.assert_array_equal(ids, [[3, 3, 1, 2]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1]])


def test_truncate_left_keeps_tail():
    ids, mask = pad_left([[1, 2, 3, 4, 5], [6]], pad_id=0, length=3, truncate="left")
    np.testing.assert_array_equal(ids, [[3, 4, 5], [0, 0, 6]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    ids, _ = pad_left([[1] * 3 + [2] * 7], pad_id=0, bucket_sizes=(4, 8), truncate="left")
    np.testing.assert_array_equal(ids, [[1] + [2] * 7])


def test_truncate_error_names_row():
    with pytest.raises(ValueError, match=r"row 1 has length 5"):
        pad_left([[1], [1, 2, 3, 4, 5]], pad_id=0, length=4)


def test_empty_row_is_error():
    with pytest.raises(ValueError, match=r"row 2 is empty"):
        pad_left([[1], [2], []], pad_id=0)


def test_encode_prompts(tok):
    texts = ["the fox", "what is 1 + 2 = ?"]
    ids, mask = tok.encode_prompts(texts, length=24)
    assert ids.shape == mask.shape == (2, 24)
    for i, text in enumerate(texts):
        row = ids[i][mask[i] == 1].tolist()
        assert row == tok.encode(text, add_bos=True)
        assert (ids[i][mask[i] == 0] == tok.pad_id).all()
    assert tok.decode_batch(ids, mask) == texts
    with pytest.raises(ValueError, match="row 0"):
        tok.encode_prompts(["the quick brown fox jumps over the lazy dog"], length=4)


def test_decode_batch_with_mask_ignores_pad(tok):
    import jax.numpy as jnp

    a, b = tok.encode("fox 7"), tok.encode("dog")
    width = max(len(a), len(b)) + 2
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    ids[0, 1 : 1 + len(a)], mask[0, 1 : 1 + len(a)] = a, 1
    ids[1, : len(b)], mask[1, : len(b)] = b, 1
    # A masked-out position holding a real token must not be decoded.
    ids[1, -1] = a[0]
    assert tok.decode_batch(jnp.asarray(ids), jnp.asarray(mask)) == ["fox 7", "dog"]
    assert tok.decode_batch(ids[:1]) == ["fox 7"]  # no mask: pads dropped


def test_missing_file_names_file(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer.load(missing)


def test_corrupt_file_names_file(tmp_path):
    bad = tmp_path / "garbage.model"
    bad.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="garbage.model"):
        Tokenizer(bad)


def test_overrides_and_pad_fallback(model_path):
    tok = Tokenizer(model_path, pad_id=3, bos_id=1, eos_id=2)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (3, 1, 2)
    # pad_id 0 is a valid override (no truthiness fallbacks)
    assert Tokenizer(model_path, pad_id=0, eos_id=0).pad_id == 0
    with pytest.raises(ValueError, match="pad_id"):
        Tokenizer(model_path, pad_id=10_000)


def test_model_without_pad_falls_back_to_eos(tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "nopad"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(50)),
        model_prefix=str(prefix),
        vocab_size=100,
        model_type="char",
        hard_vocab_limit=False,
        bos_id=-1,
        minloglevel=2,
    )
    tok = Tokenizer(f"{prefix}.model")
    assert tok.bos_id is None and tok.eos_id == 2 and tok.pad_id == tok.eos_id
    with pytest.raises(ValueError, match="no bos"):
        tok.encode("x", add_bos=True)
    ids, mask = tok.encode_prompts(["the dog"], add_bos=False, length=12)
    assert tok.decode(ids[0]) == "the dog"


def test_pickle_round_trip(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("fox 1") == tok.encode("fox 1")
    assert (clone.pad_id, clone.bos_id, clone.eos_id) == (tok.pad_id, tok.bos_id, tok.eos_id)


@pytest.mark.parametrize("model_type", ["unigram", "char"])
def test_other_model_types(tmp_path, model_type):
    path = train_sentencepiece(
        _corpus(100), tmp_path / model_type, vocab_size=100, model_type=model_type
    )
    tok = Tokenizer(path)
    assert tok.decode(tok.encode("the lazy dog 12")) == "the lazy dog 12"


def test_train_vocab_too_small_is_clear_error(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=10"):
        train_sentencepiece(_corpus(50), tmp_path / "small", vocab_size=10, model_type="unigram")
