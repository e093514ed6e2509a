"""The openai-agents SDK against ``areno serve``: an Agent on the SDK's default model (``OpenAIResponsesModel``,
POST /v1/responses) with a function tool, on the checkpoint overfit to think and then call get_weather. The run calls
the tool with the model's arguments and ends with its result as the final output (``stop_on_first_tool``: the tiny
model is overfit on the first turn only, so a second turn would run to its token limit, which the SDK reports as an
error, as it does for OpenAI's own incomplete responses); a streamed run gives the same items."""

import asyncio
import json

import pytest

agents = pytest.importorskip("agents", reason="openai-agents is a test extra: bash scripts/install.sh --test")

from openai import AsyncOpenAI  # noqa: E402

from tests.serve.test_tool_calls_e2e import MESSAGES, TOOL  # noqa: E402


def weather_agent(base_url: str, calls: list):
    """The agent on the SDK's default (Responses) model, with the get_weather tool exactly as the checkpoint saw it."""
    async def invoke(ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return json.dumps({"city": calls[-1]["city"], "temperature": 21})

    fn = TOOL["function"]
    tool = agents.FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                               on_invoke_tool=invoke, strict_json_schema=False)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    return agents.Agent(name="weather", model="tiny", tools=[tool], tool_use_behavior="stop_on_first_tool",
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=64))


@pytest.mark.parametrize("stream", [False, True])
def test_agent_calls_the_tool_and_finishes(thinking_server, stream):
    calls: list = []
    agent = weather_agent(thinking_server.base_url, calls)
    assert isinstance(agent.model if not isinstance(agent.model, str) else
                      agents.models.openai_provider.OpenAIProvider().get_model(agent.model),
                      agents.OpenAIResponsesModel)

    async def run():
        if not stream:
            return await agents.Runner.run(agent, MESSAGES[0]["content"], max_turns=3)
        result = agents.Runner.run_streamed(agent, MESSAGES[0]["content"], max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert calls == [{"city": "Paris"}]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["reasoning_item", "tool_call_item", "tool_call_output_item"], kinds
    assert json.loads(result.final_output) == {"city": "Paris", "temperature": 21}
    (raw,) = result.raw_responses
    assert raw.response_id.startswith("resp_") and raw.usage.output_tokens > 0
