"""``areno serve`` reads tool calls in the served family's format: the format chosen by the checkpoint's model_type
(or ``--tool-call-format``), and a chat answer in it, whole and streamed, as OpenAI ``tool_calls`` (with
``reasoning_content`` where the format marks reasoning), through the same code the routes run."""

import json

import pytest

from areno.config import ConfigError, ServeConfig
from areno.engine.async_engine import TokenEvent
from areno.engine.tool_calls import FORMATS
from areno.serve.chunks import ChunkWriter
from areno.serve.protocol import ChatCompletionRequest, parse
from areno.serve.routes.chat import ChatStream, chat_response, wants_calls
from areno.serve.server import serve_tool_format
from areno.serve.state import ServeState
from areno.serve.tool_stream import BLOCK_ENDS, HEADS

HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
MARKERS = ["<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"]  # special tokens
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.mark.parametrize("model_type, flag, name", [
    ("gpt_oss", "auto", "harmony"), ("qwen3_5_moe", "auto", "qwen3_coder"), ("gemma4", "auto", "gemma4"),
    ("deepseek_v3", "auto", "deepseek_v3"), ("qwen3", "auto", "qwen3"), ("olmo2", "auto", "qwen3"),
    ("qwen3", "harmony", "harmony")])
def test_the_served_format_is_the_model_types_or_the_flags(tmp_path, model_type, flag, name):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert serve_tool_format(ServeConfig(model_path=str(tmp_path), tool_call_format=flag)).name == name


def test_an_unknown_format_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--tool-call-format.*must be one of auto, qwen3, qwen3_coder"):
        ServeConfig(model_path="x", tool_call_format="hermes")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from areno.models import load_tokenizer
    from areno.testing.tokenizer import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(folder)
    tok = load_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": HARMONY + MARKERS})  # the markers are special tokens
    return tok


def answer(tokenizer, fmt: str, text: str, body: dict):
    """(whole message, finish) and (final streamed delta, finish) of ``text`` (ended by the stop token <|call|>)
    served in format ``fmt``."""
    state = ServeState(None, tokenizer, model_name="tiny", max_model_len=512, max_running=4,
                       tool_format=FORMATS[fmt])
    req = parse(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}).encode(),
                ChatCompletionRequest)
    ids = tokenizer.encode(text, add_special_tokens=False) + tokenizer.convert_tokens_to_ids(["<|call|>"])
    out = [{"ids": ids, "logprobs": [0.0] * len(ids), "top": [None] * len(ids), "finish": "stop", "stop_text": None}]
    read = wants_calls(req) or state.tool_format.always_read  # as the route decides
    assert read
    (choice,) = chat_response(state, req, out, read, 0)
    stream = ChatStream(state, req, ChunkWriter("id", "chat.completion.chunk", 0, "tiny", 3, None), read, 0)
    events = [TokenEvent(0, t, 0.0) for t in ids]
    events[-1].finish_reason = "stop"
    sent = [stream.sample_chunk(0, [ev]) for ev in events]
    if fmt not in HEADS and fmt not in BLOCK_ENDS:
        assert all(text is None for text in sent[:-1])  # calls are read once, at the end
    answer.early = merged("".join(text for text in sent[:-1] if text), ended=False)  # what went out before the end
    return choice, merged("".join(text for text in sent if text))


def merged(sse: str, ended: bool = True) -> dict:
    """The streamed choice of SSE chunks joined as the SDKs join them: content pieces concatenated, tool calls by
    index (id, name from the first delta, arguments pieces joined); the finish reason comes in an empty chunk of
    its own (``ended``)."""
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in sse.split("\n\n") if line]
    *body, end = choices if ended else [*choices, {"delta": {}, "finish_reason": None}]
    assert not ended or end["delta"] == {} and end["finish_reason"]
    assert all(c["finish_reason"] is None for c in body)
    delta, calls = {}, {}
    for c in body:
        for key in ("content", "reasoning_content"):
            if key in c["delta"]:
                delta[key] = delta.get(key, "") + c["delta"][key]
        for tc in c["delta"].get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"index": tc["index"], "function": {"arguments": ""}})
            assert "id" not in tc or ("id" not in call and tc["function"]["arguments"] == "")  # id once, first
            call.update({k: tc[k] for k in ("id", "type") if k in tc})
            call["function"].setdefault("name", tc["function"].get("name"))
            call["function"]["arguments"] += tc["function"].get("arguments", "")
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"delta": delta, "finish_reason": end["finish_reason"]}


def test_a_harmony_answer_whole_and_streamed(tokenizer):
    text = ("<|channel|>analysis<|message|>Weather needs the tool.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Kyiv", "days": 2}')
    choice, last = answer(tokenizer, "harmony", text, {"tools": TOOLS})
    msg = choice["message"]
    assert choice["finish_reason"] == last["finish_reason"] == "tool_calls"
    assert msg["content"] is None and msg["reasoning_content"] == "Weather needs the tool."
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Kyiv", "days": 2}'}
    assert last["delta"]["reasoning_content"] == msg["reasoning_content"] and last["delta"].get("content") is None
    assert [{k: v for k, v in c.items() if k not in ("id", "index")} for c in last["delta"]["tool_calls"]] == \
        [{k: v for k, v in call.items() if k != "id"}] and last["delta"]["tool_calls"][0]["index"] == 0


@pytest.mark.parametrize("body", [{"tools": TOOLS}, {}, {"tools": TOOLS, "tool_choice": "none"}])
def test_a_harmony_final_answer_is_content_without_markup(tokenizer, body):
    text = "<|channel|>analysis<|message|>No tool needed.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    choice, last = answer(tokenizer, "harmony", text, body)  # harmony is read with tools or without
    assert choice["message"] == {"role": "assistant", "content": "Hello!", "reasoning_content": "No tool needed."}
    assert choice["finish_reason"] == last["finish_reason"] == "stop"
    assert last["delta"] == {"content": "Hello!", "reasoning_content": "No tool needed."}


def test_qwen3_coder_arguments_are_typed_by_the_requests_tools(tokenizer):
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSevilla\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    choice, last = answer(tokenizer, "qwen3_coder", text, {"tools": TOOLS})
    msg = choice["message"]
    assert msg["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Sevilla", "days": 3}
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Sevilla", "days": 3}


def test_a_call_where_the_request_has_no_tools_stays_text(tokenizer):
    assert ServeState(None, tokenizer, model_name="tiny", max_model_len=512, max_running=4).tool_format.name == \
        "qwen3"  # the default: what areno read before formats were per family
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    choice, last = answer(tokenizer, "harmony", text, {})
    plain = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert choice["message"] == {"role": "assistant", "content": plain} and choice["finish_reason"] == "stop"
    assert last["delta"] == {"content": plain} and last["finish_reason"] == "stop"


@pytest.mark.parametrize("fmt, text", [
    ("harmony", '<|channel|>final<|message|>Sure.<|end|><|start|>assistant<|channel|>commentary to=functions.f '
                '<|constrain|>json<|message|>{"a": 1}'),
    ("qwen3", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')])
def test_tool_choice_none_cuts_the_call_markup(tokenizer, fmt, text):
    choice, last = answer(tokenizer, fmt, text, {"tools": TOOLS, "tool_choice": "none"})
    assert choice["message"] == {"role": "assistant", "content": "Sure."} and choice["finish_reason"] == "stop"
    assert last == {"delta": {"content": "Sure."}, "finish_reason": "stop"}


@pytest.mark.parametrize("fmt, text", [
    ("harmony", '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"a": 1}'),
    ("qwen3", '<tool_call>\n{"name": "rm_rf", "arguments": {"a": 1}}\n</tool_call>')])
def test_a_call_to_an_undeclared_function_stays_content(tokenizer, fmt, text):
    choice, last = answer(tokenizer, fmt, text, {"tools": TOOLS})
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert "rm_rf" in choice["message"]["content"] and last["delta"]["content"] == choice["message"]["content"]


def test_the_agentic_rollout_reads_the_policys_format_as_the_server_does(tokenizer):
    from types import SimpleNamespace

    from areno.engine.tool_calls import special_tokens
    from areno.rl.agentic.rollout import AgentRollout

    text = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima"}')
    ids = tokenizer.encode(text, add_special_tokens=False) + tokenizer.convert_tokens_to_ids(["<|call|>"])
    agent = SimpleNamespace(tool_format=FORMATS["harmony"], tokenizer=tokenizer,
                            special_tokens=special_tokens(tokenizer))
    message = AgentRollout.assistant_message(agent, ids, None, tokenizer.decode(ids, skip_special_tokens=True), TOOLS)
    served, _ = answer(tokenizer, "harmony", text, {"tools": TOOLS})
    strip = [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]]
    assert strip == [{k: v for k, v in c.items() if k != "id"} for c in served["message"]["tool_calls"]]
    assert {k: v for k, v in message.items() if k != "tool_calls"} == \
        {k: v for k, v in served["message"].items() if k != "tool_calls"}
    assert message["reasoning_content"] == "Use the tool."


CALL_ARGS = '{"city": "Kyiv",  "days": 2}'  # as written: two spaces, kept (the arguments are sent as generated)


@pytest.mark.parametrize("fmt, text", [
    ("qwen3", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n</tool_call>'),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {CALL_ARGS}}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("deepseek_v3", f"Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    f"```json\n{CALL_ARGS}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", f"Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                f"<|tool_call_argument_begin|>{CALL_ARGS}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1"
                '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')])
def test_json_arguments_stream_as_generated_and_equal_the_whole_answer(tokenizer, fmt, text):
    choice, last = answer(tokenizer, fmt, text, {"tools": TOOLS})
    msg = choice["message"]
    assert choice["finish_reason"] == last["finish_reason"] == "tool_calls"
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "get_weather", "arguments": CALL_ARGS}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert last["delta"].get("content") == msg.get("content") == (None if fmt == "llama3_json" else "Let me check.")
    streamed = last["delta"]["tool_calls"]
    assert [c["function"] for c in streamed] == [c["function"] for c in msg["tool_calls"]]
    early = answer.early["delta"]["tool_calls"]  # before the last token: the calls' heads, the first's arguments
    assert len(early) == (1 if fmt == "llama3_json" else 2) and early[0]["function"]["arguments"] == CALL_ARGS
    # (llama3's later calls, after ";" without a header of their own, go out at the end)
    if fmt == "kimi_k2":  # Kimi's own ids, streamed too
        assert [c["id"] for c in streamed] == [c["id"] for c in msg["tool_calls"]] == ["functions.get_weather:0",
                                                                                       "functions.get_weather:1"]


@pytest.mark.parametrize("fmt, text", [
    ("gemma4", '<|channel>thought\nA call? <|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><channel|>'
               'Checking.<|tool_call>call:get_weather{city:<|"|>Kyiv<|"|>,days:2}<tool_call|>'
               '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")])
def test_calls_in_other_markup_go_out_whole_as_each_block_closes(tokenizer, fmt, text):
    """gemma4 and qwen3_coder: each call (its arguments converted to JSON) once its block is closed; a call inside
    Gemma 4's thought is not one; streamed == whole."""
    choice, last = answer(tokenizer, fmt, text, {"tools": TOOLS})
    msg = choice["message"]
    assert choice["finish_reason"] == last["finish_reason"] == "tool_calls" and msg["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Kyiv", "days": 2},
                                                                                   {"city": "Oslo"}]
    assert [c["function"] for c in last["delta"]["tool_calls"]] == [c["function"] for c in msg["tool_calls"]]
    assert last["delta"]["content"] == "Checking."
    early = answer.early["delta"]["tool_calls"]  # before the stop token: both calls, whole
    assert [c["function"] for c in early] == [c["function"] for c in msg["tool_calls"]]
    cut = text.rindex("<")  # the last block not closed yet: only the first call has gone out
    answer(tokenizer, fmt, text[:cut], {"tools": TOOLS})
    assert [c["function"] for c in answer.early["delta"]["tool_calls"]] == [msg["tool_calls"][0]["function"]]
