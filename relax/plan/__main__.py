"""``python -m relax.plan grpo --target ...``: the same as ``relax plan grpo --target ...``."""

import sys

from relax.plan.cli import main

sys.exit(main(["plan", *sys.argv[1:]]))
