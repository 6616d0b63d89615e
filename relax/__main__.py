"""``python -m relax <command> [flags]``: the same as ``relax <command> [flags]`` (``relax.commands``)."""

import sys

from relax.commands import main

if __name__ == "__main__":
    sys.exit(main())
