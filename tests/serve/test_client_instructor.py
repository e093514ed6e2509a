"""instructor's default TOOLS mode against a real ``areno serve``: it sends the response model as a tool with
``tool_choice`` naming it; the call runs under its grammar, so even a random checkpoint returns a valid object on the
first try (no retries)."""

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

instructor = pytest.importorskip("instructor", reason="instructor is not installed")


class Booking(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: Literal[1, 2, 3]
    rail: bool


def test_tools_mode_returns_a_valid_object(tools_server):
    raw = openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    booking, completion = client.chat.completions.create_with_completion(
        model="tiny", response_model=Booking, max_retries=0, temperature=0, max_tokens=96,
        messages=[{"role": "user", "content": "Plan a trip."}])
    assert isinstance(booking, Booking)
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.choices[0].message.tool_calls[0].function.name == "Booking"
