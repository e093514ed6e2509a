"""GSM8K with a calculator: ``async def run_agent(ctx, batch)`` for ``areno train --agent-fn``.

Each sample is one conversation with the policy through ``ctx.client(item)`` (an ``openai.AsyncOpenAI`` bound to the
sample's session on the rollout's local endpoint). The request offers one tool, ``calculator(expression)``; while the
policy's replies call it, the agent evaluates each call and sends the results back as ``tool`` messages, for up to
``MAX_TURNS`` replies. The reply without a tool call is the final answer, which ``reward.py`` (``--reward-fn-path``)
scores, so ``run_agent`` returns None. A conversation that outgrows ``--max-context-len`` ends there (its last reply
is scored like any other).

The calculator evaluates arithmetic without ``eval``: the expression is parsed with ``ast.parse(mode="eval")`` and a
small walker computes numbers, ``+ - * / // % **``, unary signs and parentheses; names, calls, attributes, subscripts
and every other node are refused with a message, exponents and magnitudes are bounded, and a refusal is the tool's
result (``error: ...``), never an exception.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re

MAX_TURNS = 6
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "for example (48 + 24) * 3 / 2"}},
        "required": ["expression"]}}}]


# ---- the agent ---------------------------------------------------------------------------------------------------
async def run_agent(ctx, batch):
    import openai

    for item in batch.iter_samples():
        messages = list(item.messages)
        async with ctx.client(item) as client:
            for _ in range(MAX_TURNS):
                try:
                    reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                except openai.BadRequestError as e:
                    if e.code == "context_length_exceeded":
                        break  # the conversation is full: its last reply is the answer
                    raise
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break  # the final answer
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function.name, call.function.arguments)})
    return None  # reward.py scores the final reply


def run_tool(name: str, arguments: str) -> str:
    """The result of one tool call, as the text the policy reads next."""
    if name != "calculator":
        return f"error: unknown tool {name!r} (the only tool is calculator)"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return "error: the arguments are not a JSON object"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), (str, int, float)):
        return 'error: call calculator with {"expression": "..."}'
    return calculator(str(args["expression"]))


# ---- the calculator ----------------------------------------------------------------------------------------------
MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is what the model is told."""


def normalise(expression: str) -> str:
    """The forms people (and GSM8K) write, as Python arithmetic: ``1,000`` -> ``1000``, ``$5`` -> ``5``, ``3 x 4``
    and ``3 × 4`` -> ``3 * 4``, ``÷`` -> ``/``, ``^`` -> ``**``."""
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), expression)
    text = text.replace("$", "").replace("×", "*").replace("÷", "/").replace("^", "**")
    return re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", text)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``CalculatorError`` saying why when it is refused."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    text = normalise(expression).strip()
    if not text:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise CalculatorError(str(e)) from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        return _checked(result)
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {_describe(node)}")


def _checked(value):
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"the result is out of range (|x| > {MAX_MAGNITUDE:g})")
    return value


def _describe(node) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"a {type(node).__name__} expression"


def format_number(value) -> str:
    """``72`` for whole numbers (``72.0`` too), else the float rounded to 10 significant digits (``0.2``)."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def calculator(expression: str) -> str:
    """The tool: the value as text, or ``error: ...`` (a tool result, never an exception)."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"
