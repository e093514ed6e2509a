"""A synthetic visual counting task: pictures of coloured squares, "How many red squares?".

Each picture is a 4 x 4 grid of 8-pixel cells (32 x 32 pixels, so each of the tiny Qwen3-VL's image tokens, a 2 x 2
merge of 4-pixel patches, covers one cell). Between 0 and 4 cells hold a red square, up to 4 others a blue or green
one (the distractors), the rest stay background; square sizes, positions inside the cell and shades vary a little.
The answer is the number of red squares.

``python examples/vision/shapes.py OUT --train 2000 --eval 200`` writes ``OUT/images/*.png`` and ``OUT/data.jsonl``:
one row per picture, ``{"prompt": [user message: the picture (a path relative to the file) and the question],
"response": "3", "answer": "3"}``, the held-out rows marked ``"split": "eval"`` (the pictures differ from every
training picture). ``areno train --dataset-path OUT/data.jsonl`` reads it as it is.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CELL, GRID = 8, 4
QUESTION = "How many red squares?"
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
MAX_RED = 4


def draw(rng: random.Random) -> tuple[object, int]:
    """One picture and its red-square count."""
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (CELL * GRID, CELL * GRID), background)
    pen = ImageDraw.Draw(image)
    cells = rng.sample(range(GRID * GRID), GRID * GRID)
    reds = rng.randint(0, MAX_RED)
    others = rng.randint(0, 4)
    for k, cell in enumerate(cells[: reds + others]):
        name = "red" if k < reds else rng.choice(["blue", "green"])
        colour = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[name])
        size = rng.randint(4, 7)
        x0 = (cell % GRID) * CELL + rng.randint(0, CELL - size)
        y0 = (cell // GRID) * CELL + rng.randint(0, CELL - size)
        pen.rectangle([x0, y0, x0 + size - 1, y0 + size - 1], fill=colour)
    return image, reds


def row(image_path: str, count: int, split: str | None) -> dict:
    prompt = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_path}},
                                           {"type": "text", "text": QUESTION}]}]  # fmt: skip
    out = {"prompt": prompt, "response": str(count), "answer": str(count)}
    if split:
        out["split"] = split
    return out


def make_dataset(folder, *, train: int, eval: int, seed: int = 0) -> Path:
    """Write ``train + eval`` pictures and ``data.jsonl`` into ``folder``; returns the JSON-lines file."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < train + eval:
        image, count = draw(rng)
        key = image.tobytes()
        if key in seen:  # held-out pictures never appear in training
            continue
        seen.add(key)
        name = f"images/{len(rows):05d}.png"
        image.save(folder / name)
        rows.append(row(name, count, "eval" if len(rows) >= train else None))
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_dataset(args.out, train=args.train, eval=args.eval, seed=args.seed))


if __name__ == "__main__":
    main()
