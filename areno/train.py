"""`python -m areno.train [flags]` is `areno train [flags]` (the form torchrun and launchers call)."""

import os
import sys


def main(argv=None) -> int:
    from areno.cli import run_train

    if argv is None and "RANK" not in os.environ:  # the program, not a torchrun rank: supervised like `areno train`
        from areno.distributed.supervise import as_supervised

        rc = as_supervised(["train", *sys.argv[1:]])
        if rc is not None:
            return rc
    return run_train(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
