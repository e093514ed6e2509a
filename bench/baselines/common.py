"""What the baseline scripts share: their command line (the parts to run, ``--smoke``) and one JSON line per record."""

from __future__ import annotations

import argparse
import json

import torch


def run_parts(doc: str, parts: dict, argv=None, add_arguments=None) -> None:
    """Run the parts named on the command line (all of ``parts`` by default) and print each record they yield.

    ``parts`` maps a name (``K1``, ``T1``, ...) to ``fn(args, device)`` yielding dicts; ``device`` is "cuda" when a GPU
    is there and ``--smoke`` is not given, else "cpu". ``add_arguments(parser)`` adds a script's own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("parts", nargs="*", help=f"any of {' '.join(parts)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script; times meaningless)")
    if add_arguments is not None:
        add_arguments(ap)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.parts) - set(parts))
    if unknown:
        ap.error(f"unknown parts {unknown}: choose from {' '.join(parts)}")
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    for name in args.parts or list(parts):
        for record in parts[name](args, device):
            print(json.dumps({**record, "gpu": gpu, "torch": torch.__version__}), flush=True)
