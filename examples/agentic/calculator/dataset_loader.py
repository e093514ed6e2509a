"""GSM8K rows for the calculator agent (``--dataset-loader-fn examples/agentic/calculator/dataset_loader.py``).

``--dataset-path`` is a GSM8K JSON lines file (rows ``{"question", "answer"}``, the answer ending with ``#### N``), a
folder holding one (``train.jsonl`` is picked), or the hub reference ``gsm8k:main`` (the default). Each row becomes a
chat prompt asking to use the calculator and to put the final answer within ``\\boxed{}``, with the reference answer
``N`` (commas removed, parsed by ``examples/math/dataset_loader.py``) and the full reference solution. Rows that
carry ``split`` keep it.
"""

import importlib.util
from pathlib import Path

INSTRUCTION = "Use the calculator tool for the arithmetic, then put your final answer within \\boxed{}."


def _math_loader():
    """examples/math/dataset_loader.py, imported by path (the examples are plain folders, not packages)."""
    path = Path(__file__).resolve().parents[2] / "math" / "dataset_loader.py"
    spec = importlib.util.spec_from_file_location("areno_examples_math_dataset_loader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


final_answer = _math_loader().final_answer  # the text after the last ####, thousands commas removed


def load_training_dataset(path, *, default_loader, **kwargs):
    out = []
    for row in default_loader(path or "gsm8k:main", **kwargs):
        solution = str(row["answer"])
        new = {"prompt": [{"role": "user", "content": f"{row['question'].strip()}\n{INSTRUCTION}"}],
               "answer": final_answer(solution), "solution": solution}
        if "split" in row:  # held-out rows stay held out
            new["split"] = row["split"]
        out.append(new)
    return out
