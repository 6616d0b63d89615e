"""relax.text.stop_strings: completions cut at the token that completes a stop string, against a
brute-force reference that decodes every prefix; the GRPO score stage and evaluation use it."""

import numpy as np
import pytest

from relax.algorithms.online.batch import HostRecord, Sampled
from relax.algorithms.online.stages import make_score
from relax.compose import WithHost
from relax.text.stop_strings import truncate_at_stop_strings

# a toy vocabulary whose tokens are multi-character, so stop strings fall across token boundaries
VOCAB = ["<pad>", "a", "b", "</", "ans", "wer>", "\n", "\nQ", "uestion:", "xy"]


def decode(tokens, mask):
    return ["".join(VOCAB[t] for t, m in zip(row, mr) if m) for row, mr in zip(tokens, mask)]


def brute_force(row, m, stops):
    """The first t with a stop string in the text of tokens[:t+1] (every prefix decoded)."""
    valid = [t for t, k in zip(row, m) if k]
    for t in range(len(valid)):
        if any(s in "".join(VOCAB[x] for x in valid[: t + 1]) for s in stops):
            return t
    return None


def test_cut_matches_brute_force_on_random_completions():
    rng = np.random.default_rng(0)
    p, g, n = 6, 5, 12
    tokens = rng.integers(1, len(VOCAB), (p, g, n))
    lengths = rng.integers(0, n + 1, (p, g))
    mask = (np.arange(n) < lengths[..., None]).astype(np.int32)
    finished = rng.random((p, g)) > 0.5
    stops = ("</answer>", "\nQuestion:", "bb")
    new_mask, new_len, new_fin = truncate_at_stop_strings(tokens, mask, finished, decode, stops)
    hits = 0
    for i in range(p):
        for j in range(g):
            t = brute_force(tokens[i, j], mask[i, j], stops)
            want = mask[i, j].copy()
            if t is not None:
                want[t + 1 :] = 0
                hits += 1
            np.testing.assert_array_equal(new_mask[i, j], want, err_msg=f"{i},{j}")
            assert new_len[i, j] == want.sum() and new_fin[i, j] == (
                finished[i, j] or t is not None
            )
    assert hits >= 3  # the random data does exercise the cut


def test_a_string_across_tokens_ends_at_the_token_that_completes_it():
    tokens = np.array([[1, 3, 4, 5, 2, 2]])  # "a" "</" "ans" "wer>" "b" "b"
    mask = np.ones_like(tokens)
    m, lengths, fin = truncate_at_stop_strings(
        tokens, mask, np.array([False]), decode, ("</answer>",)
    )
    assert m.tolist() == [[1, 1, 1, 1, 0, 0]] and lengths.tolist() == [4] and fin.tolist() == [True]
    same = truncate_at_stop_strings(tokens, mask, np.array([False]), decode, ())
    assert same[0].tolist() == mask.tolist() and not same[2][0]
    with pytest.raises(ValueError, match="non-empty"):
        truncate_at_stop_strings(tokens, mask, np.array([False]), decode, ("",))


def test_score_stage_cuts_before_the_rewards_see_the_text():
    seen = []

    def reward(prompts, completions, **fields):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    stage = make_score([reward], decode, stop_strings=("</answer>",))
    tokens = np.array([[[1, 3, 4, 5, 2, 2], [1, 1, 2, 2, 2, 2]]])
    ids = np.ones((1, 2), np.int32)
    rollout = Sampled(
        prompt_ids=ids,
        prompt_mask=ids,
        tokens=tokens,
        mask=np.ones_like(tokens),
        old_logprobs=np.zeros(tokens.shape, np.float32),
        lengths=np.full((1, 2), 6),
        finished=np.zeros((1, 2), bool),
        policy_version=np.zeros((1, 2), np.int32),
    )
    _, out = stage(None, WithHost(rollout, HostRecord(prompts=["q"], fields={})))
    assert seen == ["a</answer>", "aabbbb"] and out.host.completions == seen
    scored = out.device
    assert np.asarray(scored.lengths).tolist() == [[4, 6]] and np.asarray(
        scored.finished
    ).tolist() == [[True, False]]
    assert np.asarray(scored.mask).tolist() == [[[1, 1, 1, 1, 0, 0], [1] * 6]]
    assert np.asarray(scored.rewards).tolist() == [[10.0, 6.0]]
