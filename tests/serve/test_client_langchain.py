"""LangChain (langchain-openai's ``ChatOpenAI``) against a real ``areno serve``: ``bind_tools`` with a forced
``tool_choice`` and ``with_structured_output(method="function_calling")`` (a named tool choice underneath) come back
as parsed tool calls / a validated object; a random checkpoint makes them because the call runs under its grammar."""

from typing import Literal

import pytest
from pydantic import BaseModel

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")


class Booking(BaseModel):
    """Book a trip."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def chat(tools_server):
    return langchain_openai.ChatOpenAI(model="tiny", base_url=tools_server.base_url + "/v1", api_key="unused",
                                       temperature=0, max_tokens=96, max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", ["Booking", "any"])
def test_bind_tools_with_a_forced_choice(chat, tool_choice):
    msg = chat.bind_tools([Booking], tool_choice=tool_choice).invoke("Plan a trip.")
    (call,) = msg.tool_calls
    assert call["name"] == "Booking" and call["id"].startswith("call_")
    Booking.model_validate(call["args"])
    assert msg.response_metadata["finish_reason"] == "tool_calls" and not msg.invalid_tool_calls


def test_with_structured_output_function_calling(chat):
    out = chat.with_structured_output(Booking, method="function_calling").invoke("Plan a trip.")
    assert isinstance(out, Booking)
