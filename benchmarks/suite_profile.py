"""The test suite's seconds per file, read from pytest's JUnit XML, printed as JSON.

Each line is ``{"bench": "suite_profile", "file": ..., "tests": ..., "seconds": ...}`` (a test's
time includes its setup, so a module fixture's cost lands on the file's first test), the last a
total. ``--write`` also stores each test's seconds (those of half a second or more) in
``tests/test_seconds.json``, which ``tests/conftest.py`` sums per file over the tests selected to
hand the heaviest files to the pytest-xdist workers first::

    .venv/bin/python -m pytest -q -n 2 --dist loadfile -m '' tests --junitxml=/tmp/suite.xml
    .venv/bin/python benchmarks/suite_profile.py /tmp/suite.xml --write
"""

from __future__ import annotations

import collections
import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import tyro

STORE = Path(__file__).resolve().parents[1] / "tests" / "test_seconds.json"
STORED_FROM = 0.5  # seconds: quicker tests count as zero when the files are ordered


@dataclasses.dataclass(frozen=True)
class Args:
    junit: tyro.conf.Positional[Path]
    """pytest's ``--junitxml`` output."""
    write: bool = False
    """Store each test's seconds in tests/test_seconds.json."""


def seconds_per_test(junit: Path) -> dict[str, float]:
    """Seconds per test id (``tests/test_x.py::test_y[case]``), from a JUnit XML report."""
    seconds = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        seconds[f"{path}::{case.get('name')}"] = float(case.get("time") or 0.0)
    return seconds


def main(args: Args) -> None:
    per_test = seconds_per_test(args.junit)
    seconds, counts = collections.Counter(), collections.Counter()
    for test, s in per_test.items():
        seconds[test.split("::")[0]] += s
        counts[test.split("::")[0]] += 1
    for path, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(
            json.dumps(
                {
                    "bench": "suite_profile",
                    "file": path,
                    "tests": counts[path],
                    "seconds": round(s, 1),
                }
            )
        )
    total = {"bench": "suite_profile", "file": "all", "tests": sum(counts.values())}
    print(json.dumps({**total, "seconds": round(sum(seconds.values()), 1)}))
    if args.write:
        kept = {t: round(s, 1) for t, s in sorted(per_test.items()) if s >= STORED_FROM}
        STORE.write_text(json.dumps(kept, indent=0) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
