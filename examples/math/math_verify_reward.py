"""Reward for math answers: 1.0 when the completion's final answer equals the reference, else 0.0.

The final answer is the last ``\\boxed{...}`` (or the text after a GSM8K-style ``####``); plain numbers compare
numerically ("1,234" = "1234", "5.00" = "5", "-3"), anything else goes through ``math_verify`` (parse + verify:
fractions, LaTeX, units). With no marked answer, math_verify's own extraction over the whole completion decides, and
when it finds nothing the last number in the text does. Ordinary strings never make it raise.

Use with ``areno train --reward-fn-path examples/math/math_verify_reward.py``; ``areno eval`` also reads its
``extract_answer`` (the answer maj@K votes on).
"""

import re
import threading

from math_verify import parse, verify  # imported at load time: a missing package fails before any GPU work

NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
PLAIN = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")


def reward_fn(record) -> float:
    gold = record["answer"]
    if gold is None and record["solutions"]:
        gold = record["solutions"][0]
    completion = record["completion"]
    if gold is None or not isinstance(completion, str):
        return 0.0
    return 1.0 if is_correct(completion, reference(str(gold))) else 0.0


def extract_answer(completion: str):
    """The answer `areno eval`'s maj@K votes on: the final answer (last ``\\boxed{}``, else after ``####``, else the
    last number), a plain number written canonically ("1,234.0" -> "1234") so equal values vote together; None if
    there is none."""
    pred = final_answer(completion)
    if pred is None:
        numbers = NUMBER.findall(completion)
        pred = numbers[-1] if numbers else None
    if pred is None:
        return None
    value = to_number(pred)
    if value is None:
        return pred.strip() or None
    return str(int(value)) if value == int(value) else repr(value)


def reference(answer: str) -> str:
    """The reference answer: after the last ``####`` if there is one (a raw GSM8K solution), else as given."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def is_correct(completion: str, gold: str) -> bool:
    pred = final_answer(completion)
    if pred is not None:
        return same_answer(pred, gold)
    parsed = _parse(completion)
    if parsed:
        return _verify(_parse_gold(gold), parsed)
    numbers = NUMBER.findall(completion)
    return bool(numbers) and same_answer(numbers[-1], gold)


def final_answer(text: str):
    """The content of the last ``\\boxed{}``/``\\fbox{}`` (nested braces allowed), else the line after ``####``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    return None


def last_boxed(text: str):
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):].strip().split()  # "\boxed 18"
        return rest[0] if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: no usable boxed answer


def to_number(text: str):
    """A float for a plain number ("1,234", "$5.00", "-3.", "18%", "x = 7", "18 dollars"), else None."""
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r" \1", text.split("=")[-1])
    s = re.sub(r"(?<=[\d.])\s*[A-Za-z][A-Za-z .]*$", "", s.strip())  # trailing units: "18 dollars", "5 cm"
    s = s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\%", "%")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s).replace(" ", "").rstrip(".").rstrip("%")
    if PLAIN.fullmatch(s):
        return float(s)
    return None


def same_answer(pred: str, gold: str) -> bool:
    a, b = to_number(pred), to_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    parsed = _parse(f"${pred}$") or _parse(pred)
    if parsed:
        return _verify(_parse_gold(gold), parsed)
    numbers = NUMBER.findall(pred)  # math_verify found nothing: the last number of the marked answer
    if numbers and b is not None:
        return to_number(numbers[-1]) == b
    return pred.strip() == gold.strip()


def _timeout():
    # math_verify's timeouts use signal.alarm, which only works on the main thread
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(text: str):
    try:
        return parse(text, parsing_timeout=_timeout())
    except Exception:  # noqa: BLE001 - a parser failure means "no answer found", not a crash
        return []


def _parse_gold(gold: str):
    return _parse(f"${gold}$") or _parse(gold) or [gold]


def _verify(gold, pred) -> bool:
    try:
        return bool(verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:  # noqa: BLE001
        return False
