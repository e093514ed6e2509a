"""examples/agentic: the calculator agent on GSM8K and tic-tac-toe against a scripted opponent.

The tools and the game are unit-tested directly (the calculator against GSM8K's own ``<<expr=value>>`` annotations,
the opponent's win/block/centre/corner rule, the judging, move parsing). Each agent then runs through ``TrainLoop``
on a tiny checkpoint, twice: with the checkpoint's own (random) policy for two RL steps, which shows the plumbing
holds, and with a scripted policy in place of the engine's sampler, whose replies call the tools, which shows the
agent executes the calls, feeds the results back and gets the reward right.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from areno.config import TrainConfig
from areno.rl.loop import TrainLoop
from areno.rl.rewards import record_from
from areno.testing import make_tiny_checkpoint
from areno.training.data import load_rows
from areno.training.plugins import load_dataset_loader, load_module, load_reward_fn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "agentic"
CALC = EXAMPLES / "calculator"
TTT = EXAMPLES / "tictactoe"
GSM8K = ROOT / "tests" / "data" / "gsm8k"
ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")


@pytest.fixture(scope="module")
def calc():
    return load_module(CALC / "agent.py", flag="--agent-fn")


@pytest.fixture(scope="module")
def ttt():
    return load_module(TTT / "agent.py", flag="--agent-fn")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("agentic-examples") / "ckpt", family="qwen3", seed=0)


def gsm8k_solutions() -> dict:
    """question -> reference solution, over the fixture's train and test rows."""
    out = {}
    for name in ("train.jsonl", "test.jsonl"):
        for line in (GSM8K / name).read_text().splitlines():
            row = json.loads(line)
            out[row["question"].strip()] = row["answer"]
    return out


# ---- the calculator ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression,expected", [
    ("48/2", "24"), ("48 + 24", "72"), ("12/60", "0.2"), ("0.2*50", "10"), ("(48 + 24) * 3 / 2", "108"),
    ("2**10", "1024"), ("-3 + 5", "2"), ("7 // 2", "3"), ("10 % 3", "1"), ("1,000 * 3", "3000"), ("$5 x 4", "20"),
    ("3 × 4", "12"), ("12 ÷ 4", "3"), ("2^3", "8"), ("1/3", "0.3333333333"), ("  +7 ", "7"),
])
def test_calculator_values(calc, expression, expected):
    assert calc.calculator(expression) == expected


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "Call"), ("open('x')", "Call"), ("a + 1", "name 'a'"),
    ("(1).real", "Attribute"), ("[1, 2][0]", "Subscript"), ("1 < 2", "Compare"), ("lambda: 1", "Lambda"),
    ("True + 1", "constant True"), ("'a' * 3", "constant 'a'"), ("1, 2", "Tuple"), ("9**9**9", "exponents"),
    ("10**20", "out of range"), ("1/0", "division by zero"), ("(-8)**0.5", "not a real number"), ("(", "parse"),
    ("", "empty"), ("1+" * 150 + "1", "longer than"),
])
def test_calculator_refuses_without_raising(calc, expression, why):
    out = calc.calculator(expression)
    assert out.startswith("error: ") and why in out, out


def test_calculator_agrees_with_the_gsm8k_annotations(calc):
    """Every ``<<expr=value>>`` of the fixture's reference solutions evaluates to its annotated value."""
    checked = 0
    for solution in gsm8k_solutions().values():
        for expression, value in ANNOTATION.findall(solution):
            expected = float(value.replace(",", ""))
            assert float(calc.calculator(expression)) == pytest.approx(expected, rel=1e-6, abs=1e-6), expression
            checked += 1
    assert checked > 50


def test_tool_dispatch(calc):
    assert calc.run_tool("calculator", '{"expression": "6*7"}') == "42"
    assert calc.run_tool("calculator", {"expression": 5}) == "5"
    assert calc.run_tool("search", "{}").startswith("error: unknown tool")
    assert calc.run_tool("calculator", "{not json").startswith("error:")
    assert calc.run_tool("calculator", '{"expr": "1"}').startswith("error:")


def test_loader_and_reward():
    loader = load_dataset_loader(str(CALC / "dataset_loader.py"))
    reward = load_reward_fn(str(CALC / "reward.py"))
    rows = load_rows(str(GSM8K / "train.jsonl"), loader_fn=loader)
    assert len(rows) == 15 and rows[0]["answer"] == "72"
    assert rows[0]["prompt"][0]["content"].startswith("Natalia sold clips") and "calculator" in rows[0]["prompt"][0][
        "content"]
    assert load_rows(str(GSM8K), loader_fn=loader) == rows  # a folder: its train.jsonl
    row = rows[0]
    final = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "48+24"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "72"}, {"role": "assistant", "content": "\\boxed{72}"}]
    assert reward(record_from({**row, "messages": final}, "\\boxed{72}", [], 0)) == 1.0
    assert reward(record_from({**row, "messages": final}, "\\boxed{71}", [], 0)) == 0.0
    assert reward(record_from({**row, "messages": final[:1]}, "72", [], 0)) == 0.0  # ended on a tool call
    assert reward(record_from(row, '<tool_call>\n{"name": "calculator"}\n</tool_call> 72', [], 0)) == 0.0
    assert reward(record_from(row, "So she sold \\boxed{72} clips.", [], 0)) == 1.0  # a one-turn evaluation


# ---- tic-tac-toe -------------------------------------------------------------------------------------------------
def board_of(ttt, text: str) -> dict:
    """``"X.O/.X./..O"`` -> a board."""
    cells = text.replace("/", "")
    board = ttt.new_board()
    for i, ch in enumerate(cells, start=1):
        board[i] = None if ch == "." else ch
    return board


def test_judging(ttt):
    assert ttt.result(board_of(ttt, "XXX/OO./...")) == ttt.WIN
    assert ttt.result(board_of(ttt, "XX./OOO/X..")) == ttt.LOSS
    assert ttt.result(board_of(ttt, "X.O/.O./OX.")) == ttt.LOSS  # a diagonal
    assert ttt.result(board_of(ttt, "XOX/XOO/OXX")) == ttt.DRAW
    assert ttt.result(board_of(ttt, "XO./.X./..O")) is None
    assert ttt.render(board_of(ttt, "X.O/.X./..O")) == "X 2 O\n4 X 6\n7 8 O"


@pytest.mark.parametrize("board,expected,why", [
    ("XX./OO./X..", 6, "O wins before it blocks"),
    ("XX./.O./...", 3, "blocks X's row"),
    ("X../.O./..X", 3, "no win or block: the first free corner"),
    ("X../.../...", 5, "the centre"),
    ("XOX/OOX/X.X", 8, "blocks the last cell"),
    ("OXO/XXO/OOX", None, "a full board has no move"),
    ("X.X/OXO/OXO", 2, "the only free cell"),
])
def test_opponent_rule(ttt, board, expected, why):
    b = board_of(ttt, board)
    if expected is None:
        with pytest.raises(StopIteration):
            ttt.opponent_move(b)
    else:
        assert ttt.opponent_move(b) == expected, why


def test_the_opponent_loses_to_a_fork_and_never_to_a_plain_line(ttt):
    b = ttt.new_board()
    for x in (1, 9, 7):  # X 1, O 5, X 9, O 3 (a corner), X 7 blocks 3-5-7 and threatens 4 and 8
        b[x] = "X"
        b[ttt.opponent_move(b)] = "O"
    assert b[5] == b[3] == b[4] == "O" and ttt.result(b) is None
    b[8] = "X"
    assert ttt.result(b) == ttt.WIN
    b = ttt.new_board()
    b[1] = "X"
    b[ttt.opponent_move(b)] = "O"
    b[2] = "X"
    assert ttt.opponent_move(b) == 3  # blocks


@pytest.mark.parametrize("content,calls,expected", [
    (None, [("move", '{"cell": 5}')], 5), ("", [("move", '{"cell": "7"}')], 7), (None, [("move", '{"cell": 0}')], None),
    (None, [("move", '{"cell": true}')], None), (None, [("move", "{bad")], None), (None, [("move", '{"c": 5}')], None),
    ("I play 3", [], 3), ("3", [], 3), ("3 or 5", [], None), ("cell 10", [], None), ("no idea", [], None),
    ("ignored 4", [("other", "{}"), ("move", '{"cell": 2}')], 2),
])
def test_parse_move(ttt, content, calls, expected):
    assert ttt.parse_move(content, calls) == expected


def test_openings(ttt):
    rows = load_dataset_loader(str(TTT / "agent.py"))(None, default_loader=None)
    assert [r["opening"] for r in rows] == list(range(10))
    assert rows[0]["prompt"][0]["content"].endswith("You move first.\n1 2 3\n4 5 6\n7 8 9")
    assert rows[5]["prompt"][0]["content"].endswith("I played 5.\n1 2 3\n4 O 6\n7 8 9")


# ---- through TrainLoop -------------------------------------------------------------------------------------------
def make_loop(ckpt, tmp_path, **kw):
    cfg = TrainConfig(ckpt=str(ckpt), algo="grpo", batch_size=2, n_samples=2, mini_bs=4, max_new_tokens=8,
                      dtype="float32", lr=1e-3, tensorboard=False, metrics_dir=str(tmp_path / "m"), seed=0,
                      temperature=1.0)
    loop = TrainLoop(replace(cfg, **kw))
    loop.setup()
    return loop


class ScriptedStream:
    def __init__(self, ids):
        from areno.engine.async_engine import TokenEvent

        self.seqs = []
        self.events = [TokenEvent(0, t, -1.0, "stop" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def pending(self):
        out, self.events = self.events, []
        return out


class ScriptedEngine:
    """Stands in for the AsyncEngine the agentic rollout samples with: ``policy(context_text) -> reply_text``, the
    reply encoded and ended with the end-of-turn token, so the endpoint, sessions, agent and reward run as they do."""

    def __init__(self, tokenizer, policy):
        self.tok, self.policy = tokenizer, policy

    async def submit(self, prompt_ids, options, *, mm=None, final_only=False):  # AsyncEngine.submit's signature
        reply = self.policy(self.tok.decode(prompt_ids, skip_special_tokens=False))
        return ScriptedStream(self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id])

    def shutdown(self, drain=False):
        pass


def script(monkeypatch, loop, policy):
    import areno.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "AsyncEngine", lambda *args, **kwargs: ScriptedEngine(loop.tokenizer, policy))


def tool_call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_calculator_agent_trains_two_steps_on_the_tiny_checkpoint(ckpt, tmp_path):
    loop = make_loop(ckpt, tmp_path, dataset_path=str(GSM8K / "train.jsonl"), agent_fn=str(CALC / "agent.py"),
                     dataset_loader_fn=str(CALC / "dataset_loader.py"), reward_fn_path=str(CALC / "reward.py"))
    try:
        batches = iter(loop.data)
        for _ in range(2):
            m = loop.step(next(batches))
            assert m["samples"] == 4 and m["reward_failures"] == 0 and m["agent_turns_mean"] >= 1
            assert 0.0 <= m["reward_mean"] <= 1.0
        assert "loss" in m or m.get("skipped")
    finally:
        loop.close()


def test_calculator_agent_runs_every_call_and_the_reward_reads_the_final_answer(ckpt, tmp_path, monkeypatch):
    """A scripted policy that makes GSM8K's own calculations through the tool, one per turn, then boxes the last
    result: the agent returns each value, and the reward is 1 exactly where that value is the reference answer."""
    solutions = gsm8k_solutions()
    calc_module = load_module(CALC / "agent.py", flag="--agent-fn")

    def policy(context):
        question = next(q for q in solutions if q in context)
        steps = ANNOTATION.findall(solutions[question])
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
        if len(results) < len(steps):
            return tool_call("calculator", expression=steps[len(results)][0])
        boxed = results[0] if question.startswith("Weng") else results[-1]  # Weng's first result is wrong (0.2)
        return f"The answer is \\boxed{{{boxed}}}."

    loop = make_loop(ckpt, tmp_path, dataset_path=str(GSM8K / "train.jsonl"), agent_fn=str(CALC / "agent.py"),
                     dataset_loader_fn=str(CALC / "dataset_loader.py"), reward_fn_path=str(CALC / "reward.py"),
                     max_context_len=2048, batch_size=4)
    script(monkeypatch, loop, policy)
    try:
        batch = [p.row for p in loop.rows[:4]]
        rows, stats = loop.rollout(loop.rows[:4])
        assert stats["reward_failures"] == 0 and stats["agent_forks"] == 0 and len(rows) == 8
        for row in rows:
            src = next(r for r in batch if r["prompt"] == [m for m in row.meta["messages"] if m["role"] == "user"][:1])
            question = src["prompt"][0]["content"].split("\n")[0].strip()
            steps = ANNOTATION.findall(solutions[next(q for q in solutions if q.startswith(question))])
            messages = row.meta["messages"]
            calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
            results = [m["content"] for m in messages if m["role"] == "tool"]
            assert len(calls) == len(steps) == len(results)
            for (expression, value), call, got in zip(steps, calls, results):
                assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"expression": expression}
                assert got == calc_module.calculator(expression)
                assert float(got) == pytest.approx(float(value.replace(",", "")))
            boxed = re.search(r"boxed\{(.*)\}", messages[-1]["content"]).group(1)
            assert row.reward == (1.0 if float(boxed) == float(src["answer"]) else 0.0)
            # the tool results are context, not trained: the loss mask covers the sampled replies only
            assert sum(row.loss_mask) < len(row.response_ids)
        assert sorted(r.reward for r in rows) == [0.0] * 2 + [1.0] * 6  # Weng's two samples boxed 0.2
    finally:
        loop.close()


def test_tictactoe_agent_trains_two_steps_on_the_tiny_checkpoint(ckpt, tmp_path):
    loop = make_loop(ckpt, tmp_path, dataset_loader_fn=str(TTT / "agent.py"), agent_fn=str(TTT / "agent.py"))
    try:
        batches = iter(loop.data)
        ttt = load_module(TTT / "agent.py", flag="--agent-fn")
        for _ in range(2):
            m = loop.step(next(batches))
            assert m["samples"] == 4 and m["reward_failures"] == 0
            assert ttt.FORFEIT <= m["reward_min"] <= m["reward_max"] <= ttt.WIN
    finally:
        loop.close()


# opening -> the cells X plays, how (tool call or plain text), and the result
GAMES = {0: ([1, 9, 7, 8], "tool", "WIN"), 5: ([1, 7, 6, 2], "text", "DRAW"), 2: ([1, 3], "tool", "LOSS"),
         9: ([9], "tool", "FORFEIT")}


def test_tictactoe_agent_plays_the_moves_and_scores_the_result(ckpt, tmp_path, monkeypatch, ttt):
    def policy(context):
        opening = 0 if "You move first." in context else int(re.search(r"I played (\d)\.", context).group(1))
        cells, how, _ = GAMES[opening]
        cell = cells[context.count("You played")]
        return tool_call("move", cell=cell) if how == "tool" else f"I take {cell}"

    loop = make_loop(ckpt, tmp_path, dataset_loader_fn=str(TTT / "agent.py"), agent_fn=str(TTT / "agent.py"),
                     max_context_len=2048, batch_size=4)
    script(monkeypatch, loop, policy)
    try:
        batch = [p for p in loop.rows if p.row["opening"] in GAMES]
        rows, stats = loop.rollout(batch)
        assert stats["reward_failures"] == 0 and len(rows) == 8
        for row in rows:
            opening = next(p.row["opening"] for p in batch if p.row["prompt"][0] == row.meta["messages"][0])
            cells, how, outcome = GAMES[opening]
            assert row.reward == getattr(ttt, outcome), opening
            replies = [m for m in row.meta["messages"] if m["role"] == "assistant"]
            assert len(replies) == len(cells)
            news = [m for m in row.meta["messages"][1:] if m["role"] in ("tool", "user")]
            assert len(news) == len(cells) - 1  # the last move ends the game: nothing sent back
            assert all(m["role"] == ("tool" if how == "tool" else "user") for m in news)
        win = next(r for r in rows if r.reward == ttt.WIN)
        news = [m["content"] for m in win.meta["messages"] if m["role"] == "tool"]
        assert news[0] == "You played 1, I played 5.\nX 2 3\n4 O 6\n7 8 9"
        assert news[-1] == "You played 7, I played 4.\nX 2 O\nO O 6\nX 8 X"
    finally:
        loop.close()
