"""Tool calls through the endpoint: a tiny checkpoint overfit (seconds, fp32 on CPU) to answer one conversation with
a ``get_weather`` call, served for real and read back through the official openai client."""

import json

import openai
import pytest
import torch

from areno.serve.protocol import Tool
from tests.serve.conftest import RunningServer

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TARGET = CALL + "<|im_end|>"


def overfit_tool_caller(src, dst, *, margin=4.0, max_steps=300, target=TARGET):
    """Train ``src`` until greedy decoding of the rendered conversation gives ``target`` by a logit margin; save to
    ``dst``. The prompt is rendered exactly as the server renders it (tools through the protocol model)."""
    from areno.models import load_model, load_tokenizer, save_model

    tok = load_tokenizer(src)
    tools = [Tool.model_validate(TOOL).model_dump(exclude_none=True)]
    prompt = tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
    p = tok.encode(prompt, add_special_tokens=False)
    labels = torch.tensor(tok.encode(target, add_special_tokens=False))
    ids = torch.tensor([p + labels.tolist()])
    torch.manual_seed(0)
    model = load_model(src, dtype=torch.float32, device="cpu")
    model.train()
    for prm in model.parameters():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(max_steps):
        logits = model.logits(ids)[0, len(p) - 1 : -1].float()
        right = logits.gather(1, labels[:, None])[:, 0]
        other = logits.scatter(1, labels[:, None], float("-inf")).amax(1)
        if (right - other).min().item() > margin:
            break
        loss = torch.nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise AssertionError(f"the tool caller did not reach a {margin} logit margin in {max_steps} steps")
    model.eval()
    return save_model(model, dst, tok)


@pytest.fixture(scope="module")
def tool_ckpt(tmp_path_factory):
    from areno.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path_factory.mktemp("tool_src"), family="qwen3", seed=5, num_hidden_layers=1)
    return overfit_tool_caller(src, tmp_path_factory.mktemp("tool_ckpt") / "model")


@pytest.fixture(scope="module")
def tool_server(tool_ckpt):
    s = RunningServer(tool_ckpt)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(calls):
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")


def test_tool_call_non_streaming(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[TOOL], temperature=0,
                                         max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_call(choice.message.tool_calls)
    assert out.usage.completion_tokens == 23  # the call's tokens and <|im_end|>


def test_tool_call_streaming(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[TOOL], temperature=0,
                                                 max_tokens=64, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert {tc.index for tc in calls} == {0} and [tc.id for tc in calls if tc.id] == [calls[0].id]
    calls[0].function.arguments = "".join(tc.function.arguments or "" for tc in calls)  # joined as the SDKs join
    _check_call(calls[:1])
    assert "".join(d.delta.content or "" for d in deltas) == ""  # the call text never leaks out as content
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]


def test_tool_choice_none_hides_the_tools_and_cuts_call_markup(client):
    """"none": the template renders no tools (another prompt: the overfit call is not what comes back) and any call
    markup is cut from the content, streamed or not alike."""
    kw = dict(model="tiny", messages=MESSAGES, tools=[TOOL], tool_choice="none", temperature=0, max_tokens=32)
    choice = client.chat.completions.create(**kw).choices[0]
    deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == (choice.message.content or "")
    assert "<tool_call>" not in (choice.message.content or "") and not choice.message.tool_calls
    assert not any(d.delta.tool_calls for d in deltas) and choice.finish_reason != "tool_calls"
    assert [d.finish_reason for d in deltas if d.finish_reason] == [choice.finish_reason]


def test_the_sdk_stream_helper_sees_argument_deltas_and_done(client):
    """OpenAI's shape: the first tool-call delta has id, type and name with arguments ""; the arguments follow in
    pieces as generated; finish_reason comes in a chunk of its own; the stream helper's events join to the
    non-streamed call (greedy)."""
    kw = dict(model="tiny", messages=MESSAGES, tools=[TOOL], temperature=0, max_tokens=64)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    first = next(c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls)
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    pieces = [tc.function.arguments for c in chunks for tc in c.delta.tool_calls or () if tc.function.arguments]
    assert len(pieces) > 1 and "".join(pieces) == whole.function.arguments  # in pieces, as generated
    assert chunks[-1].finish_reason == "tool_calls" and not chunks[-1].delta.tool_calls
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
    deltas = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert "".join(deltas) == done.arguments == whole.function.arguments and done.name == "get_weather"


def test_an_undeclared_function_stays_content(client):
    """The model calls get_weather; a request declaring only another function gets that text as content."""
    other = {"type": "function", "function": {**TOOL["function"], "name": "get_time"}}
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[other], temperature=0,
                                            max_tokens=64).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"


def test_no_tools_no_tool_calls(client):
    """Without ``tools`` the server does not parse calls, whatever the model says."""
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason != "tool_calls"


def test_another_tool_call_format_changes_what_is_read(tool_ckpt):
    """``--tool-call-format llama3_json`` on this qwen3 checkpoint: its Qwen-style block is not a Llama 3 call, so it
    comes back as content (the qwen3 default, by model_type, read it as a call above)."""
    s = RunningServer(tool_ckpt, tool_call_format="llama3_json")
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        choice = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=[TOOL], temperature=0,
                                           max_tokens=64).choices[0]
        assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    finally:
        s.stop()
