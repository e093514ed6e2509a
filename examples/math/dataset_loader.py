"""GSM8K rows for ``areno train --dataset-loader-fn examples/math/dataset_loader.py``.

Works with the hub reference (``--dataset-path gsm8k:main``) and with a local copy (``--dataset-path
path/to/train.jsonl``, rows ``{"question", "answer"}`` where the answer ends with ``#### N``). Each row becomes a chat
prompt that asks for step-by-step reasoning and a ``\\boxed{}`` final answer, plus the reference answer ``N`` (commas
removed) for ``math_verify_reward.py`` and the full reference solution.
"""

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def final_answer(solution: str) -> str:
    """The text after the last ``####`` of a GSM8K solution, thousands commas removed."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


def load_training_dataset(path, *, default_loader, **kwargs):
    rows = default_loader(path or "gsm8k:main", **kwargs)
    out = []
    for row in rows:
        solution = str(row["answer"])
        new = {
            "prompt": [{"role": "user", "content": f"{row['question'].strip()}\n{INSTRUCTION}"}],
            "answer": final_answer(solution),
            "solution": solution,
        }
        if "split" in row:  # held-out rows stay held out
            new["split"] = row["split"]
        out.append(new)
    return out
