"""Tic-tac-toe against a scripted opponent: ``async def run_agent(ctx, batch)`` for ``areno train --agent-fn``, and the
openings to train on for ``--dataset-loader-fn`` (this same file).

The policy plays X, the opponent O. Cells are numbered 1-9, row by row; the board is shown with its free cells'
numbers (``X 2 O`` ...). Each turn the policy moves by calling the ``move`` tool with ``{"cell": N}`` (a reply with
no tool call whose text holds a single free cell number counts too). The agent applies the move, lets the opponent
answer and sends the new board back (a ``tool`` message after a tool call, a ``user`` message after a plain-text
move), until the game ends, through ``ctx.client(item)`` (an ``openai.AsyncOpenAI`` bound to the sample's session
on the rollout's local endpoint). The reward is the result: ``WIN`` 1.0, ``DRAW`` 0.5, ``LOSS`` 0.0, and ``FORFEIT``
-1.0 for a reply with no legal move (below a loss, so a policy learns to play legal moves first).

The opponent is deterministic (``opponent_move``): it wins if it can, else blocks X's win, else takes the centre,
else the first free corner, else the first free edge. It never misses a win or a block but does not see forks:
after X 1, O 5, X 9 it takes the corner 3, X must block at 7 and then threatens 4 and 8 at once, so a policy can
learn to beat it.

The rows (``load_training_dataset``): the ten openings, X to move on the empty board or after O's first move on
each cell. ``--dataset-path`` is not needed (``--dataset-loader-fn`` alone builds the rows).
"""

from __future__ import annotations

import json
import re

WIN, DRAW, LOSS, FORFEIT = 1.0, 0.5, 0.0, -1.0
LINES = ((1, 2, 3), (4, 5, 6), (7, 8, 9), (1, 4, 7), (2, 5, 8), (3, 6, 9), (1, 5, 9), (3, 5, 7))
CORNERS, EDGES, CENTRE = (1, 3, 7, 9), (2, 4, 6, 8), 5
TOOLS = [{"type": "function", "function": {
    "name": "move",
    "description": "Put your X on a free cell (1-9, row by row).",
    "parameters": {"type": "object", "properties": {"cell": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["cell"]}}}]
RULES = ("Let's play tic-tac-toe. You are X, I am O. Cells are numbered 1-9 row by row; the board shows the free "
         "cells' numbers. Make your move with the move tool.")


# ---- the game ----------------------------------------------------------------------------------------------------
def new_board() -> dict:
    return {cell: None for cell in range(1, 10)}


def free_cells(board: dict) -> list[int]:
    return [cell for cell in range(1, 10) if board[cell] is None]


def winner(board: dict) -> str | None:
    for a, b, c in LINES:
        if board[a] is not None and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: dict) -> str:
    """Three lines, a free cell shown as its number: ``X 2 O\\n4 X 6\\n7 8 9``."""
    return "\n".join(" ".join(board[c] or str(c) for c in range(row, row + 3)) for row in (1, 4, 7))


def completing_cell(board: dict, player: str) -> int | None:
    """The first free cell that completes a line of ``player``'s, or None."""
    for cell in free_cells(board):
        for line in LINES:
            if cell in line and all(board[c] == player for c in line if c != cell):
                return cell
    return None


def opponent_move(board: dict, me: str = "O", other: str = "X") -> int:
    """The scripted opponent's cell: win, else block, else the centre, else the first free corner, else edge."""
    for player in (me, other):
        cell = completing_cell(board, player)
        if cell is not None:
            return cell
    if board[CENTRE] is None:
        return CENTRE
    return next(c for c in CORNERS + EDGES if board[c] is None)


def result(board: dict) -> float | None:
    """The game's reward for X once it is over (a line or a full board), else None."""
    w = winner(board)
    if w is not None:
        return WIN if w == "X" else LOSS
    return DRAW if not free_cells(board) else None


def parse_move(content: str | None, tool_calls) -> int | None:
    """The cell a reply plays: the ``move`` call's ``cell`` (``tool_calls``: ``(name, arguments)`` pairs, arguments
    as JSON text), else the single digit 1-9 of a plain-text reply; None when the reply names no cell."""
    for name, arguments in tool_calls:
        if name != "move":
            continue
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            return None
        cell = args.get("cell") if isinstance(args, dict) else None
        if isinstance(cell, str) and cell.strip().isdigit():
            cell = int(cell)
        return cell if isinstance(cell, int) and not isinstance(cell, bool) and 1 <= cell <= 9 else None
    digits = re.findall(r"(?<!\d)[1-9](?!\d)", content or "")
    return int(digits[0]) if len(set(digits)) == 1 else None


# ---- the agent ---------------------------------------------------------------------------------------------------
def opening_board(opening: int) -> dict:
    """Opening 0: the empty board; 1-9: O has played that cell."""
    board = new_board()
    if opening:
        board[opening] = "O"
    return board


async def play(client, messages: list, board: dict) -> float:
    """Play the game to its end from ``board`` (X to move), ``messages`` the conversation so far; the reward."""
    import openai

    while True:
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as e:
            if e.code == "context_length_exceeded":  # the replies filled --max-context-len before the game ended
                return FORFEIT
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        cell = parse_move(message.content, calls)
        if cell is None or board[cell] is not None:
            return FORFEIT
        board[cell] = "X"
        outcome = result(board)
        if outcome is None:
            reply_cell = opponent_move(board)
            board[reply_cell] = "O"
            outcome = result(board)
            news = f"You played {cell}, I played {reply_cell}.\n{render(board)}"
        else:
            news = f"You played {cell}.\n{render(board)}"
        if outcome is not None:
            return outcome
        if message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": news})
        else:
            messages.append({"role": "user", "content": news})


async def run_agent(ctx, batch):
    rewards = {}
    for item in batch.iter_samples():
        board = opening_board(int(item.record.get("opening", 0)))
        async with ctx.client(item) as client:
            rewards[item.id] = await play(client, list(item.messages), board)
    return rewards


# ---- the rows ----------------------------------------------------------------------------------------------------
def load_training_dataset(path=None, *, default_loader=None, **kwargs) -> list[dict]:
    rows = []
    for opening in range(10):
        board = opening_board(opening)
        first = "You move first." if not opening else f"I played {opening}."
        rows.append({"prompt": [{"role": "user", "content": f"{RULES}\n{first}\n{render(board)}"}],
                     "opening": opening})
    return rows
