"""The verifiable task of ``benchmarks/real_model.py``: short arithmetic word problems of five
kinds (``data_source``: add_sub, multiply, change, rate_plus, two_step), each answered with a
non-negative integer; deterministic by seed, train and held-out rows disjoint."""

from __future__ import annotations

import random

NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dan",
    "Ella",
    "Finn",
    "Grace",
    "Hugo",
    "Iris",
    "Jack",
    "Kim",
    "Leo",
    "Maya",
    "Noah",
    "Olivia",
    "Paul",
    "Rosa",
    "Sam",
    "Tara",
    "Omar",
)
ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "books",
    "cards",
    "shells",
    "coins",
    "stamps",
)


def _problem(rng: random.Random) -> tuple[str, int, str]:
    """One word problem: ``(question, answer, kind)``; every answer is a non-negative integer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("add_sub", "multiply", "change", "rate_plus", "two_step"))
    if kind == "add_sub":
        a, b = rng.randint(5, 40), rng.randint(3, 30)
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. How many {item} does {name} have now?"  # noqa: E501
        ans = a + b - c
    elif kind == "multiply":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} have in total?"
        ans = a * b
    elif kind == "change":
        price, n = rng.randint(2, 9), rng.randint(2, 6)
        bill = next(x for x in (10, 20, 50, 100) if x > price * n)
        q = (
            f"One pack of {item} costs {price} dollars. {name} buys {n} packs and pays with a {bill} dollar bill. "
            f"How many dollars of change does {name} get?"
        )
        ans = bill - price * n
    elif kind == "rate_plus":
        a, d, extra = rng.randint(3, 15), rng.randint(2, 7), rng.randint(1, 20)
        q = (
            f"{name} collects {a} {item} every day for {d} days, and then finds {extra} more. "
            f"How many {item} does {name} have?"
        )
        ans = a * d + extra
    else:  # two_step: share equally after adding
        per, k = rng.randint(2, 9), rng.randint(2, 6)
        total = per * k
        a = rng.randint(1, total - 1)
        q = (
            f"{name} has {a} {item} and gets {total - a} more. {name} shares all of them equally among {k} friends. "
            f"How many {item} does each friend get?"
        )
        ans = per
    return q + " Give the final answer as a number.", ans, kind


def make_rows(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows ``{"prompt", "answer", "data_source"}``, deterministic by seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_eval:
        q, ans, kind = _problem(rng)
        if q not in seen:
            seen.add(q)
            rows.append({"prompt": q, "answer": str(ans), "data_source": kind})
    return rows[n_eval:], rows[:n_eval]
