import functools
import logging
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.rewards.builtin import (
    exact_match,
    extract_number,
    format_reward,
    get_reward,
    make_exact_match,
    make_format_reward,
    make_numeric_match,
    numeric_match,
    parse_answer_number,
)
from relax.rewards.functions import (
    RewardError,
    RewardFunction,
    combine_checked,
    score,
    score_groups,
)
from relax.rewards.token_rewards import (
    TokenRewardFunction,
    length_reward,
    score_tokens,
    token_match_reward,
)

NAN = np.nan
PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["4", "seven", "x"]


# ----------------------------------------------------------------------------- host score


def graded(prompts, completions, answer, difficulty, **_):
    """Uses two extra dataset columns; None where the answer is unknown."""
    return [
        None if a is None else (float(c == a) * d)
        for c, a, d in zip(completions, answer, difficulty)
    ]


def length_fn(prompts, completions, **_):
    return [len(c) for c in completions]  # ints are fine


def test_score_fields_none_and_weights():
    fields = {"answer": ["4", "7", None], "difficulty": [2.0, 3.0, 1.0]}
    total, per, info = score(
        [RewardFunction(graded, weight=0.5), RewardFunction(length_fn, name="len", weight=-1.0)],
        PROMPTS,
        COMPLETIONS,
        fields,
    )
    np.testing.assert_array_equal(per["graded"], np.array([2.0, 0.0, NAN], np.float32))
    np.testing.assert_array_equal(per["len"], [1.0, 5.0, 1.0])
    # NaN skipped in the weighted sum, per-function values unweighted
    np.testing.assert_allclose(total, [0.5 * 2 - 1, 0.0 - 5, -1.0])
    assert total.dtype == np.float32 and total.shape == (3,)
    assert info["missing"] == 1 and info["all_missing"] == 0
    assert info["errors"] == 0 and info["timeouts"] == 0 and info["failed"] == ()
    assert set(info) >= {"time_s/graded", "time_s/len"}


def test_score_all_missing_and_plain_callables():
    def none_fn(prompts, completions, **_):
        return [None, 1.0, None]

    total, per, info = score(
        [none_fn], PROMPTS, COMPLETIONS
    )  # plain callable: weight 1, its __name__
    np.testing.assert_array_equal(total, [NAN, 1.0, NAN])
    assert list(per) == ["none_fn"] and info["all_missing"] == 2
    total0, _, _ = score([none_fn], PROMPTS, COMPLETIONS, all_missing="zero")  # TRL's nansum
    np.testing.assert_array_equal(total0, [0.0, 1.0, 0.0])
    # functools.partial is named after the wrapped function
    total_p, per_p, _ = score(
        [functools.partial(graded, difficulty=[1, 1, 1])],
        PROMPTS,
        COMPLETIONS,
        {"answer": ["4", "4", "4"]},
    )
    assert list(per_p) == ["graded"]
    np.testing.assert_array_equal(total_p, [1.0, 0.0, 0.0])


def test_score_input_validation():
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        score([length_fn], PROMPTS, COMPLETIONS[:2])
    with pytest.raises(ValueError, match="field 'answer' has 2 values for 3"):
        score([length_fn], PROMPTS, COMPLETIONS, {"answer": [1, 2]})
    with pytest.raises(ValueError, match="duplicate reward names"):
        score([length_fn, length_fn], PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="raise, missing"):
        score([length_fn], PROMPTS, COMPLETIONS, on_error="ignore")
    with pytest.raises(ValueError, match="at least one"):
        score([], PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    "out, match",
    [
        ([1.0, 2.0], r"'bad' returned 2 values for 3 samples"),
        ([1.0, "high", 0.0], r"'bad' returned non-numeric 'high' \(str\) at sample 1"),
        ([1.0, [1, 2], 0.0], r"'bad' returned non-numeric .* at sample 1"),
        ([1.0, float("inf"), 0.0], r"'bad' returned inf at sample 1"),
        # finite as a Python float, infinite in float32: would turn the loss into NaN
        (
            [1.0, 1e39, 0.0],
            r"'bad' returned 1e\+39 at sample 1 \(beyond float32's \+-3.402823e\+38\).*"
            r"\(completion='seven'\)",
        ),
        ([np.float64(-4e38), 0.0, 0.0], r"'bad' returned -4e\+38 at sample 0 \(beyond float32"),
        (
            [0.0, 0.0, 10**400],
            r"'bad' returned 1000.*\[401 chars\] at sample 2 \(beyond float32.*completion='x'",
        ),
        (3.0, r"'bad' returned float"),
    ],
)
def test_score_return_contract(out, match):
    bad = RewardFunction(lambda prompts, completions, **_: out, name="bad")
    for on_error in ("raise", "missing"):  # contract violations always raise
        with pytest.raises(RewardError, match=match):
            score([bad], PROMPTS, COMPLETIONS, on_error=on_error)


def test_weighted_sum_overflow_names_functions_and_sample():
    big = RewardFunction(lambda p, c, **_: [1.0, 3e38, None], name="big", weight=2.0)
    with pytest.raises(
        RewardError,
        match=r"weighted sum of the rewards overflows float32 at sample 1: "
        r"'big': 2 x 3e\+38 \(completion='seven'\)",
    ):
        score([big], PROMPTS, COMPLETIONS)
    also = RewardFunction(lambda p, c, **_: [None, 2e38, 1.0], name="also")
    more = RewardFunction(lambda p, c, **_: [None, 2e38, 1e38], name="more", weight=1.5)
    with pytest.raises(
        RewardError, match=r"at sample 1: 'more': 1.5 x 2e\+38, 'also': 1 x 2e\+38 "
    ):
        score([more, also], PROMPTS, COMPLETIONS)  # sample 2: 1.5e38 + 1 is fine
    total = combine_checked(
        {"a": np.full((2, 2), 2e38), "b": np.array([[1.0, NAN], [NAN, NAN]])}, {"a": 1.0, "b": 1.0}
    )
    np.testing.assert_array_equal(total, np.full((2, 2), 2e38, np.float32))
    with pytest.raises(
        RewardError, match=r"at sample 3 \(prompt 1, completion 1\): 'a': -1 x 2e\+38, 'b'"
    ):
        combine_checked(
            {"a": np.array([[0.0, 0], [0, 2e38]]), "b": np.full((2, 2), -2e38)}, {"a": -1, "b": 1}
        )


def test_score_numeric_types():
    fn = RewardFunction(lambda p, c, **_: [True, np.float64(0.25), np.array(3)], name="types")
    _, per, _ = score([fn], PROMPTS, COMPLETIONS)
    np.testing.assert_array_equal(per["types"], [1.0, 0.25, 3.0])


def picky(prompts, completions, **_):
    """Raises only when the batch contains the completion 'seven'."""
    if "seven" in completions:
        raise ZeroDivisionError("cannot grade seven")
    return [1.0] * len(completions)


def test_raising_function_raise_names_function_and_sample():
    long_prompt = "q" * 500
    with pytest.raises(RewardError) as ei:
        score([length_fn, picky], ["a", long_prompt, "c"], COMPLETIONS)
    msg = str(ei.value)
    assert "'picky'" in msg and "ZeroDivisionError: cannot grade seven" in msg
    assert "at sample 1" in msg and "completion='seven'" in msg
    assert "[500 chars]" in msg and len(msg) < 600  # prompt truncated to ~200 chars
    assert isinstance(ei.value.__cause__, ZeroDivisionError)


def test_raising_function_unlocatable():
    def batch_only(prompts, completions, **_):
        if len(completions) > 1:
            raise RuntimeError("needs a batch of one")
        return [0.0]

    with pytest.raises(
        RewardError, match="'batch_only' raised RuntimeError.*batch of 3.*no single sample"
    ):
        score([batch_only], PROMPTS, COMPLETIONS)


def test_raising_function_missing_counts_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="relax.rewards.functions"):
        total, per, info = score([length_fn, picky], PROMPTS, COMPLETIONS, on_error="missing")
    assert np.isnan(per["picky"]).all()
    np.testing.assert_array_equal(total, per["length_fn"])  # the other function still counts
    assert info["errors"] == 1 and info["timeouts"] == 0 and info["failed"] == ("picky",)
    assert info["missing"] == 3 and info["all_missing"] == 0
    assert "picky" in caplog.text and "ZeroDivisionError" in caplog.text


def test_timeout_raise_and_missing():
    release = threading.Event()

    def slow(prompts, completions, **_):
        release.wait(10.0)
        return [1.0] * len(completions)

    try:
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match=r"'slow' timed out after 0.2s"):
            score([slow, length_fn], PROMPTS, COMPLETIONS, timeout_s=0.2)
        assert time.perf_counter() - t0 < 1.0
        t0 = time.perf_counter()
        total, per, info = score(
            [slow, length_fn], PROMPTS, COMPLETIONS, timeout_s=0.2, on_error="missing"
        )
        assert time.perf_counter() - t0 < 1.0
        assert np.isnan(per["slow"]).all() and info["timeouts"] == 1 and info["failed"] == ("slow",)
        np.testing.assert_array_equal(total, [1.0, 5.0, 1.0])
        # fast functions, and a function that raises TimeoutError itself, under a timeout
        _, per, _ = score([length_fn], PROMPTS, COMPLETIONS, timeout_s=0.2)
        np.testing.assert_array_equal(per["length_fn"], [1.0, 5.0, 1.0])

        def own_timeout(prompts, completions, **_):
            raise TimeoutError("socket")

        with pytest.raises(RewardError, match="raised TimeoutError: socket"):
            score([own_timeout], PROMPTS[:1], COMPLETIONS[:1], timeout_s=0.2)
    finally:
        release.set()  # let the abandoned threads finish


# ----------------------------------------------------------------------------- builtins


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", 42.0),
        ("first 3 then \\boxed{17} and a check 18", 17.0),  # boxed wins over later numbers
        ("\\boxed{\\frac{3}{4}}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("\\boxed{x^{2}+\\left\\{1\\right\\}}", 1.0),  # nested braces matched
        ("work 5 #### 72", 72.0),
        ("#### 1,234", 1234.0),
        ("x = -3", -3.0),
        ("10-3", 3.0),  # a hyphen after a digit is not a sign
        ("pi is about 3.14159", 3.14159),
        ("costs $1,234.50.", 1234.5),
        ("\u22127", -7.0),
        ("no number here", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        (72, 72.0),
        (-2.5, -2.5),
        ("1,234", 1234.0),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", 72.0),
        ("$5.", 5.0),
        ("\\frac{1}{3}", 1 / 3),
        ("x + 1", None),
        ("3 or 4", None),
        (None, None),
        (True, None),
        (float("nan"), None),
        ([1], None),
    ],
)
def test_parse_answer_number(answer, expected):
    assert parse_answer_number(answer) == expected


def test_numeric_match():
    completions = [
        "so \\boxed{72}",
        "#### 1,234",
        "it is -0.5",
        "0.3333333",
        "0.333",
        "none",
        "7",
        "7",
    ]
    answer = ["72", 1234, -0.5, "\\frac{1}{3}", 1 / 3, 5, "seven", None]
    out = numeric_match(["q"] * 8, completions, answer=answer)
    assert out == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, None, None]
    assert make_numeric_match(rel_tol=1e-3)(["q"], ["0.333"], answer=[1 / 3]) == [1.0]
    assert numeric_match(["q"], ["1000002"], answer=[1000000]) == [0.0]  # 2e-6 relative
    assert numeric_match(["q"], ["1000000.5"], answer=[1000000]) == [1.0]  # 5e-7 relative


def test_exact_match_and_answer_field():
    out = exact_match(
        ["q"] * 4,
        ["  Paris\n", "paris", "4", "x"],
        answer=["Paris", "Paris", 4, None],
        extra=[0] * 4,
    )
    assert out == [1.0, 0.0, 1.0, None]
    em = make_exact_match("solution")
    assert em(["q"], ["b"], solution=["b"]) == [1.0]
    with pytest.raises(KeyError, match="'solution'.*\\['answer'\\]"):
        em(["q"], ["b"], answer=["b"])


def test_format_reward():
    good = "<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>"
    bad = ["<answer>42</answer>", good + " trailing", "prefix " + good, "<think>a</think><answer>b"]
    assert format_reward(["q"] * 5, [good, *bad]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    boxed = make_format_reward(r".*\\boxed\{.+\}")
    assert boxed(["q", "q"], ["so \\boxed{3}", "3"]) == [1.0, 0.0]


def test_builtins_registry_through_score():
    assert get_reward("numeric_match") is numeric_match
    with pytest.raises(
        ValueError,
        match="unknown reward 'accuracy'; valid: code_exec, exact_match, format_reward, math_verify, numeric_match",
    ):
        get_reward("accuracy")
    fns = [
        RewardFunction(get_reward(n), weight=w)
        for n, w in (("numeric_match", 1.0), ("format_reward", 0.1))
    ]
    completions = [
        "<think>2+2</think> <answer>\\boxed{4}</answer>",
        "5",
        "<think></think><answer>x</answer>",
    ]
    total, per, _ = score(fns, PROMPTS, completions, {"answer": ["4", "4", None]})
    np.testing.assert_allclose(total, [1.1, 0.0, 0.1], rtol=1e-6)
    assert set(per) == {"numeric_match", "format_reward"}
    with pytest.raises(RewardError, match="'exact_match' raised KeyError.*at sample 0"):
        score([exact_match], PROMPTS, COMPLETIONS)


# ----------------------------------------------------------------------------- token rewards


def test_score_tokens_jit():
    p_ids = jnp.array([[0, 5, 6], [7, 8, 9]])
    p_mask = jnp.array([[False, True, True], [True, True, True]])
    c_ids = jnp.array([[[1, 2, 3, 0], [1, 9, 3, 3]], [[1, 2, 0, 0], [4, 4, 4, 4]]])
    c_mask = jnp.array([[[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 0, 0, 0], [1, 1, 1, 1]]], bool)
    fns = [token_match_reward([1, 2, 3]), length_reward(weight=-0.1)]
    total, per = score_tokens(fns, p_ids, p_mask, c_ids, c_mask)
    np.testing.assert_allclose(per["token_match"], [[1.0, 2 / 3], [1 / 3, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(per["length"], [[3, 4], [1, 4]])
    np.testing.assert_allclose(total, per["token_match"] - 0.1 * per["length"], rtol=1e-6)
    # inside an outer jit, and a target longer than the completion buffer
    long = token_match_reward([1, 2, 3, 0, 0, 0])
    out = jax.jit(lambda *a: score_tokens([long], *a)[0])(p_ids, p_mask, c_ids, c_mask)
    np.testing.assert_allclose(out, [[3 / 6, 2 / 6], [1 / 6, 0.0]], rtol=1e-6)

    nan_fn = TokenRewardFunction(lambda pi, pm, ci, cm: jnp.full(ci.shape[:2], jnp.nan), "nan")
    total, _ = score_tokens([nan_fn, fns[0]], p_ids, p_mask, c_ids, c_mask)
    np.testing.assert_allclose(total, per["token_match"], rtol=1e-6)  # missing skipped
    bad = TokenRewardFunction(lambda pi, pm, ci, cm: jnp.sum(cm, axis=(1, 2)), "bad")
    with pytest.raises(ValueError, match="'bad' returned shape \\(2,\\)"):
        score_tokens([bad], p_ids, p_mask, c_ids, c_mask)


def test_score_tokens_infinite_values_raise():
    p_ids, p_mask = jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), bool)
    c_ids, c_mask = jnp.ones((2, 2, 4), jnp.int32), jnp.ones((2, 2, 4), bool)

    def at(value, p=1, g=0):
        return lambda pi, pm, ci, cm: jnp.zeros(ci.shape[:2]).at[p, g].set(value)

    for value in (jnp.inf, -jnp.inf):
        fn = TokenRewardFunction(at(value), "blowup")
        with pytest.raises(
            RewardError,
            match=rf"token reward 'blowup' returned {value} at sample 2 "
            r"\(prompt 1, completion 0\)",
        ):
            score_tokens([length_reward(), fn], p_ids, p_mask, c_ids, c_mask)
    big = TokenRewardFunction(at(3e38, 0, 1), "big", weight=2.0)
    with pytest.raises(
        RewardError,
        match=r"overflows float32 at sample 1 \(prompt 0, completion 1\): "
        r"'big': 2 x 3e\+38, 'length': 1 x 4",
    ):  # sorted names
        score_tokens([length_reward(), big], p_ids, p_mask, c_ids, c_mask)
    total, _ = score_tokens([TokenRewardFunction(at(jnp.nan), "gap")], p_ids, p_mask, c_ids, c_mask)
    assert (
        np.isnan(total[1, 0]) and np.count_nonzero(np.isnan(total)) == 1
    )  # NaN: missing, no error


def test_hung_thread_does_not_block_exit():
    code = (
        "import time\n"
        "from relax.rewards.functions import score\n"
        "def hang(prompts, completions, **_):\n"
        "    time.sleep(1000)\n"
        "out = score([hang], ['p'], ['c'], timeout_s=0.1, on_error='missing')\n"
        "print(out[2]['timeouts'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr


def test_empty_batch():
    total, per, info = score([length_fn], [], [], {"answer": []})
    assert total.shape == (0,) and per["length_fn"].shape == (0,) and info["missing"] == 0


def test_score_groups_repeats_prompt_and_fields_over_the_group():
    """TRL's layout: completion j of prompt i sees prompt i and row i's fields; [P, G] out."""
    tokens = np.array([[[1, 2, 0], [3, 0, 0]], [[4, 5, 6], [7, 8, 0]], [[9, 0, 0], [1, 1, 1]]])
    mask = (tokens > 0).astype(np.int32)
    decode = lambda t, m: [" ".join(str(x) for x, k in zip(row, mk) if k) for row, mk in zip(t, m)]
    seen = []

    def fn(prompts, completions, answer, **_):
        seen.extend(zip(prompts, completions, answer))
        return [
            float(len(c.split())) + (10.0 if a == "y" else 0.0) for c, a in zip(completions, answer)
        ]

    total, per, _, completions = score_groups(
        [fn], decode, ["a", "b", "c"], {"answer": ["x", "y", "x"]}, tokens, mask
    )
    assert completions == ["1 2", "3", "4 5 6", "7 8", "9", "1 1 1"]
    assert seen == [
        ("a", "1 2", "x"),
        ("a", "3", "x"),
        ("b", "4 5 6", "y"),
        ("b", "7 8", "y"),
        ("c", "9", "x"),
        ("c", "1 1 1", "x"),
    ]
    np.testing.assert_array_equal(total, [[2, 1], [13, 12], [1, 3]])
    np.testing.assert_array_equal(per["fn"], total)
