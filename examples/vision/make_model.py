"""A tiny Qwen3-VL created from scratch (random weights) for the counting task of ``shapes.py``.

``python examples/vision/make_model.py OUT`` writes a Hugging Face Qwen3-VL folder: config, random weights under
the Hub's tensor names, a small BPE tokenizer with the vision tokens, a chat template and the image processor (patch
4, merge 2: a 32 x 32 picture is 16 image tokens). Text side: 3 decoder layers of width 64; vision side: 3 blocks of
width 32 with DeepStack features from the first two. It loads in transformers and in areno alike.
"""

import argparse

from areno.testing import make_tiny_checkpoint


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.out, "qwen3_vl", seed=args.seed))


if __name__ == "__main__":
    main()
