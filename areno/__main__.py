"""`python -m areno` is the `areno` command."""

import sys

from areno.cli import main

if __name__ == "__main__":
    sys.exit(main())
