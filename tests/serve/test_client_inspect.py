"""inspect-ai with tools against a real ``areno serve`` (its ``openai-api`` provider): a task whose solver forces the
``book`` tool (``ToolFunction``) gets a schema-valid call from the served model, inspect runs the tool and feeds the
result back, and the model's next turn is served too."""

from typing import Literal

import pytest

inspect_ai = pytest.importorskip("inspect_ai", reason="inspect-ai is not installed")


def test_a_forced_tool_runs_in_an_inspect_task(tools_server, tmp_path, monkeypatch):
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import ToolFunction, tool

    booked = []

    @tool
    def book():
        async def execute(city: Literal["Paris", "Oslo"], days: Literal[1, 2]) -> str:
            """Book a trip.

            Args:
                city: Where to.
                days: How long.
            """
            booked.append((city, days))
            return f"booked {city} for {days} days"

        return execute

    monkeypatch.setenv("ARENO_API_KEY", "unused")
    monkeypatch.setenv("ARENO_BASE_URL", tools_server.base_url + "/v1")
    task = Task(dataset=[Sample(input="Plan a trip.", target="booked")],
                solver=[use_tools([book()], tool_choice=ToolFunction("book")), generate(tool_calls="single")])
    (log,) = eval(task, model="openai-api/areno/tiny", log_dir=str(tmp_path), display="none",
                  temperature=0, max_tokens=96, max_retries=0, max_connections=1)
    assert log.status == "success", log.error
    messages = log.samples[0].messages
    calls = [c for m in messages if m.role == "assistant" for c in m.tool_calls or ()]
    assert calls and calls[0].function == "book" and calls[0].arguments["city"] in ("Paris", "Oslo")
    assert booked and booked[0] == (calls[0].arguments["city"], calls[0].arguments["days"])
    assert any(m.role == "tool" and "booked" in m.text for m in messages)
