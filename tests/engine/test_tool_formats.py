"""Each family's tool-call format (areno.engine.tool_calls): real-looking answers -> exact OpenAI ``tool_calls``
(single, several, around text, malformed left as content, unicode, nested JSON arguments, typed XML parameters),
and the model_type -> format mapping ``areno serve`` and the agentic rollout use."""

import json

import pytest

from areno.config.constants import TOOL_CALL_FORMATS
from areno.engine.tool_calls import FORMATS, MODEL_FORMATS, format_for, parse_tool_calls, read_answer, strip_tokens

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "temp": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "note": {"type": ["string", "null"]}, "unit": {"enum": ["c", "f"]},
    "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}


def calls_of(parsed):
    """The calls as (name, arguments object): the id is random, the arguments a JSON string."""
    for c in parsed.calls:
        assert c.id.startswith("call_") and len(c.id) == 29
        assert c.to_openai() == {"id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def parse(fmt, text, tools=None):
    return FORMATS[fmt].parse(text, tools)


def test_the_registry_and_the_config_vocabulary_agree():
    assert tuple(FORMATS) == TOOL_CALL_FORMATS[1:] and TOOL_CALL_FORMATS[0] == "auto"
    for name, fmt in FORMATS.items():  # every format reads its own example back as one call
        assert fmt.name == name and calls_of(fmt.parse(fmt.example, None))[0][0] == "f"


@pytest.mark.parametrize("model_type, name", [
    ("qwen3", "qwen3"), ("qwen3_moe", "qwen3"), ("qwen3_vl", "qwen3"), ("qwen3_5", "qwen3_coder"),
    ("qwen3_5_moe", "qwen3_coder"), ("qwen3_5_text", "qwen3_coder"), ("gemma4", "gemma4"),
    ("gemma4_text", "gemma4"), ("gpt_oss", "harmony"), ("deepseek_v3", "deepseek_v3"), ("llama", "llama3_json"),
    ("olmo3", "qwen3"), ("bailing_hybrid", "qwen3"), (None, "qwen3")])
def test_model_type_picks_the_family_format(model_type, name):
    assert format_for(model_type).name == name
    assert MODEL_FORMATS.get(model_type or "", "qwen3") == name


def test_a_named_format_overrides_the_model_type():
    assert format_for("qwen3", "harmony").name == "harmony"
    assert format_for("gpt_oss", "auto").name == "harmony"
    with pytest.raises(ValueError, match="unknown tool-call format 'hermes'; known: auto, qwen3"):
        format_for("qwen3", "hermes")


# ---- qwen3 (Hermes JSON in <tool_call>) -----------------------------------------------------------------------------
def test_qwen3_calls_text_and_malformed_blocks():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "where": '
            '{"lat": 47.4, "nested": {"a": [1, {"b": null}]}}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>\n<tool_call>{"name": "broken", "arguments": {'
            '</tool_call>')
    p = parse("qwen3", text)
    where = {"lat": 47.4, "nested": {"a": [1, {"b": None}]}}
    assert calls_of(p) == [("get_weather", {"city": "Zürich", "where": where}), ("get_time", {"tz": "CET"})]
    assert p.content == 'Let me check.\n\n\n<tool_call>{"name": "broken", "arguments": {</tool_call>'
    assert parse_tool_calls(text)[1][0].name == "get_weather"  # the old entry point: qwen3 by default
    assert parse("qwen3", "no calls here").content == "no calls here"
    assert parse("qwen3", '<tool_call>{"arguments": {}}</tool_call>').calls == []
    assert parse("qwen3", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>').calls == []
    p = parse("qwen3", '<tool_call>{"name": "open"\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert calls_of(p) == [("g", {})] and p.content == '<tool_call>{"name": "open"'  # unclosed: content


# ---- qwen3_coder (Qwen3.5: XML parameters typed by the schema) ------------------------------------------------------
def coder_call(name, params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_types_each_parameter_by_its_schema():
    text = "I'll look it up.\n\n" + coder_call("get_weather", [
        ("city", "São Paulo\nBrazil"), ("days", "3"), ("metric", "True"), ("temp", "21.5"),
        ("where", '{"lat": -23.5, "box": [1, 2]}'), ("tags", '["rain", "wind"]'), ("note", "null"),
        ("unit", "c"), ("level", "7"), ("extra", "42")])
    p = parse("qwen3_coder", text, [WEATHER])
    assert p.content == "I'll look it up."
    assert calls_of(p) == [("get_weather", {
        "city": "São Paulo\nBrazil", "days": 3, "metric": True, "temp": 21.5, "where": {"lat": -23.5, "box": [1, 2]},
        "tags": ["rain", "wind"], "note": None, "unit": "c", "level": 7, "extra": "42"})]


def test_qwen3_coder_keeps_text_that_is_not_its_declared_type():
    p = parse("qwen3_coder", coder_call("get_weather", [("days", "three"), ("metric", "yes"), ("temp", "NaN"),
                                                        ("where", "[1]"), ("level", "high"), ("city", "42")]),
              [WEATHER])
    assert calls_of(p) == [("get_weather", {"days": "three", "metric": "yes", "temp": "NaN", "where": "[1]",
                                            "level": "high", "city": "42"})]


def test_qwen3_coder_several_calls_no_schema_and_malformed():
    two = coder_call("a", [("x", "1")]) + "\n" + coder_call("b", [])
    p = parse("qwen3_coder", two)  # no tools: values stay the text written
    assert calls_of(p) == [("a", {"x": "1"}), ("b", {})] and p.content is None
    bad = [
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</function>\n</tool_call>",  # parameter never closed
        "<tool_call>\n<function=a>\nstray text<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        coder_call("a", [("x", "1"), ("x", "2")]),  # a parameter twice
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>",  # no </function>
    ]
    for text in bad:
        assert parse("qwen3_coder", text, [WEATHER]).calls == [] and parse("qwen3_coder", text).content == text
    for broken in bad:  # a broken block beside a good one: the good one is read, the broken one stays content
        p = parse("qwen3_coder", broken + "\n" + coder_call("c", []))
        assert calls_of(p) == [("c", {})] and p.content == broken


# ---- gemma4 ---------------------------------------------------------------------------------------------------------
def test_gemma4_calls_with_strings_numbers_nesting_and_reasoning():
    q = '<|"|>'
    text = (f"<|channel>thought\nThe user wants weather.<channel|>Sure.<|tool_call>call:get_weather{{city:{q}東京, "
            f'"quoted"{q},days:3,temp:-1.5e1,metric:true,note:null,where:{{lat:35.7,tags:[{q}a{q},{q}b{q}]}},'
            f"tags:[]}}<tool_call|><|tool_call>call:get_time{{}}<tool_call|>")
    p = parse("gemma4", text)
    assert p.reasoning == "The user wants weather." and p.content == "Sure."
    assert calls_of(p) == [("get_weather", {"city": '東京, "quoted"', "days": 3, "temp": -15.0, "metric": True,
                                            "note": None, "where": {"lat": 35.7, "tags": ["a", "b"]}, "tags": []}),
                           ("get_time", {})]


@pytest.mark.parametrize("block", [
    '<|tool_call>call:f{a:<|"|>open}<tool_call|>',  # an unterminated string
    "<|tool_call>call:f{a:1,}<tool_call|>", "<|tool_call>call:f{a:1 b:2}<tool_call|>",
    "<|tool_call>call:f{a:tru}<tool_call|>", "<|tool_call>call:f{a:1,a:2}<tool_call|>",
    "<|tool_call>call:f{a:1}}<tool_call|>", "<|tool_call>f{a:1}<tool_call|>", "<|tool_call>call:f[1]<tool_call|>",
    "<|tool_call>call:f{a:[1,2}<tool_call|>", "<|tool_call>call:f{a:NaN}<tool_call|>"])
def test_gemma4_malformed_blocks_stay_content(block):
    p = parse("gemma4", "before " + block + " after")
    assert p.calls == [] and p.content == "before " + block + " after"


def test_gemma4_a_malformed_block_beside_a_good_one():
    p = parse("gemma4", "<|tool_call>call:f{a:}<tool_call|>x<|tool_call>call:g{b:2}<tool_call|>")
    assert calls_of(p) == [("g", {"b": 2})] and p.content == "<|tool_call>call:f{a:}<tool_call|>x"


# ---- harmony (GPT-OSS) ----------------------------------------------------------------------------------------------
def test_harmony_reasoning_call_and_nested_arguments():
    text = ("<|channel|>analysis<|message|>Need the weather; call the tool.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Kraków", "where": {"box": [1, [2, {"z": "ü"}]]}}<|call|>')
    p = parse("harmony", text)
    assert p.reasoning == "Need the weather; call the tool." and p.content is None
    assert calls_of(p) == [("get_weather", {"city": "Kraków", "where": {"box": [1, [2, {"z": "ü"}]]}})]


def test_harmony_final_answer_preamble_and_several_calls():
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    p = parse("harmony", final)  # the <|return|> that ended it is the stop token, already cut
    assert (p.content, p.reasoning, p.calls) == ("It is 4.", "Easy.", [])
    two = ("<|channel|>commentary<|message|>Checking both.<|end|>"
           '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
           '<|start|>assistant<|channel|>commentary to=functions.b<|message|>{}')
    p = parse("harmony", two)
    assert calls_of(p) == [("a", {"x": 1}), ("b", {})] and p.content == "Checking both." and p.reasoning is None
    on_analysis = '<|channel|>analysis to=functions.a <|constrain|>json<|message|>{"x": [1]}'
    assert calls_of(parse("harmony", on_analysis)) == [("a", {"x": [1]})]  # the recipient names the function
    other_role = '<|channel|>final<|message|>ok<|end|><|start|>user<|channel|>final<|message|>hi'
    p = parse("harmony", other_role)  # a message of another role is not the assistant's: content as written
    assert p.content == "ok\n<|start|>user<|channel|>final<|message|>hi"


def test_harmony_malformed_and_foreign_messages_stay_content():
    bad = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json<|call|>"
    p = parse("harmony", bad)
    assert p.calls == [] and p.content == bad
    builtin = '<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis to=browser.search' \
              ' <|constrain|>json<|message|>{"q": "x"}<|call|>'
    p = parse("harmony", builtin)  # a built-in tool is not a declared function: its message stays content
    assert p.calls == [] and p.reasoning == "Search." and "browser.search" in p.content
    assert parse("harmony", "plain text, no channels").content == "plain text, no channels"
    odd = "<|channel|>final<|message|>hi<|end|>garbage<|channel|>final<|message|>x"
    assert parse("harmony", odd).content == odd  # not a run of messages: left whole


# ---- deepseek_v3 ----------------------------------------------------------------------------------------------------
B, E, CB, CE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>")


def ds_call(name, args):
    return f"{CB}function{SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```{CE}"


def test_deepseek_v3_section_with_several_calls():
    text = ("Let me check.\n\n" + B + ds_call("get_weather", {"city": "Αθήνα", "where": {"a": [1, {"b": 2}]}}) + "\n"
            + ds_call("get_time", {}) + E)
    p = parse("deepseek_v3", text)
    assert p.content == "Let me check."
    assert calls_of(p) == [("get_weather", {"city": "Αθήνα", "where": {"a": [1, {"b": 2}]}}), ("get_time", {})]
    v31 = B + CB + 'get_weather' + SEP + '{"city": "Oslo"}' + CE + E  # DeepSeek-V3.1's form
    assert calls_of(parse("deepseek_v3", v31)) == [("get_weather", {"city": "Oslo"})]


def test_deepseek_v3_malformed_calls_stay_content():
    broken = f"{CB}function{SEP}f\n```json\n{{oops\n```{CE}"
    text = B + broken + ds_call("g", {"x": 1}) + E
    p = parse("deepseek_v3", text)
    assert calls_of(p) == [("g", {"x": 1})] and p.content == broken
    only_bad = "hi " + B + broken + E
    assert parse("deepseek_v3", only_bad).content == only_bad and parse("deepseek_v3", only_bad).calls == []
    assert parse("deepseek_v3", "no section").content == "no section"


# ---- llama3_json ----------------------------------------------------------------------------------------------------
def test_llama3_json_whole_answer_python_tag_and_several_calls():
    p = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lyon", "where": {"n": [1, 2]}}}')
    assert calls_of(p) == [("get_weather", {"city": "Lyon", "where": {"n": [1, 2]}})] and p.content is None
    p = parse("llama3_json", 'Calling.<|python_tag|>{"name": "a", "parameters": {"q": "ß"}}; '
                             '{"name": "b", "arguments": {}}')
    assert calls_of(p) == [("a", {"q": "ß"}), ("b", {})] and p.content == "Calling."


@pytest.mark.parametrize("text", [
    'The answer is {"name": "a", "parameters": {}}',  # text before a call without the tag
    '{"name": "a", "parameters": {}} and then text', '{"name": "a", "parameters": {', '{"parameters": {}}',
    '{"name": "a", "parameters": [1]}', "<|python_tag|>print(1)", "[1, 2]"])
def test_llama3_json_anything_else_is_content(text):
    p = parse("llama3_json", text)
    assert p.calls == [] and p.content == text


def test_read_answer_strips_other_special_tokens_for_special_markup_formats():
    text = '<|python_tag|>{"name": "a", "parameters": {}}<|eom_id|>'
    p = read_answer(FORMATS["llama3_json"], "Hi<|eot_id|>", None, ("<|eot_id|>", "<|python_tag|>"))
    assert p.content == "Hi" and p.calls == []
    assert strip_tokens(" <|x|> ", ("<|x|>",)) is None
    p = read_answer(FORMATS["llama3_json"], text.replace("<|eom_id|>", ""), None, ("<|python_tag|>",))
    assert calls_of(p) == [("a", {})]
