"""`python -m areno.train [flags]` is `areno train [flags]` (the form torchrun and launchers call)."""

import sys


def main(argv=None) -> int:
    from areno.cli import run_train

    return run_train(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
