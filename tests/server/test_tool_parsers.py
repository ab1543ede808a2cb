"""Tool calling without a server: the Hermes parser (whole and streamed, every chunking adds up
to the whole answer), the forced choices' JSON schemas checked with jsonschema, the chat
template choice (the tools and the calls reach the prompt) and LLM.chat(tools=)."""

from __future__ import annotations

import json
import random
import re
import types

import jsonschema
import pytest

from shoal.runtime.entrypoints.tool_parsers import get_tool_parser, load_tool_parser_plugin, tool_parser_names
from shoal.runtime.entrypoints.tool_parsers.base import assemble
from shoal.runtime.entrypoints.tool_parsers.chat_template import hermes_template, renders_tools, template_messages, tool_template
from shoal.runtime.entrypoints.tool_parsers.choice import tool_choice_of
from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput
from shoal.runtime.entrypoints.errors import APIError

Hermes = get_tool_parser("hermes")
ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")


def hermes_text(prefix: str, calls: list[tuple[str, dict]], sep: str = "\n") -> str:
    """What a Hermes model writes: the reference the parser is checked against."""
    blocks = [f"<tool_call>{sep}{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}{sep}</tool_call>" for n, a in calls]
    return prefix + ("\n" if prefix and blocks else "") + "\n".join(blocks)


def plain(extracted) -> tuple:
    """(content, [(name, arguments as data)]): what must agree across modes (ids are random)."""
    return extracted.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in extracted.tool_calls]


def raw(extracted) -> tuple:
    return extracted.content, [(c["function"]["name"], c["function"]["arguments"]) for c in extracted.tool_calls]


def streamed(text: str, sizes, **kw) -> tuple[list[dict], object]:
    parser, deltas, i = Hermes(**kw), [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas += parser.feed(text[i:i + size])
        i += size
    if i < len(text):
        deltas += parser.feed(text[i:])
    deltas += parser.finish()
    return deltas, assemble(deltas)


def random_args(rng: random.Random, depth: int = 0) -> dict:
    keys = ["city", "unit", "q", "n", "nested", "list", "quote", "tag"]
    out = {}
    for k in rng.sample(keys, rng.randint(0, 4)):
        kind = rng.choice(["str", "int", "float", "bool", "none", "list", "obj"] if depth < 2 else ["str", "int"])
        out[k] = {"str": lambda: rng.choice(["Paris", 'say "hi"', "a}b{c", "</tool_call>", "<tool_call>", "back\\slash", "ünï", ""]),
                  "int": lambda: rng.randint(-5, 10**6), "float": lambda: rng.random(), "bool": lambda: rng.random() < 0.5,
                  "none": lambda: None, "list": lambda: [rng.randint(0, 9), "x", {"k": [1, 2]}],
                  "obj": lambda: random_args(rng, depth + 1)}[kind]()
    return out


CASES = [
    ("", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Let me look that up.", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    ("", [("no_args", {})]),
    ("Tricky strings:", [("echo", {"text": 'a "}" and </tool_call> and \\" done', "n": [1, {"x": "]"}]})]),
]


@pytest.mark.parametrize("prefix,calls", CASES)
def test_whole_text_extracts_the_calls(prefix, calls):
    text = hermes_text(prefix, calls)
    got = Hermes().extract(text)
    assert got.content == (prefix or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == calls
    assert all(ID.match(c["id"]) and c["type"] == "function" for c in got.tool_calls)
    assert len({c["id"] for c in got.tool_calls}) == len(calls)


def test_random_calls_every_chunking_adds_up_to_the_whole():
    rng = random.Random(7)
    for trial in range(60):
        calls = [(rng.choice(["f", "get_weather", "x_y-z"]), random_args(rng)) for _ in range(rng.randint(0, 3))]
        prefix = rng.choice(["", "Sure.", "I will call < tools now", "ok <tool"])
        text = hermes_text(prefix, calls, sep=rng.choice(["\n", "", " "]))
        whole = Hermes().extract(text)
        assert plain(whole) == (prefix or None, calls), text
        chunkings = [[1] * len(text), [len(text)]] + [[rng.randint(1, 9) for _ in range(len(text))] for _ in range(4)]
        for sizes in chunkings:
            deltas, got = streamed(text, sizes)
            assert raw(got) == raw(whole), (text, sizes)


def test_stream_deltas_have_openai_shape():
    text = hermes_text("Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    deltas, _ = streamed(text, [1] * len(text))
    seen_start = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"})
        if "tool_calls" in d:
            (call,) = d["tool_calls"]
            if call["index"] not in seen_start:  # the first delta of a call: id, type, name, empty arguments
                assert ID.match(call["id"]) and call["type"] == "function" and call["function"] == {"name": call["function"]["name"], "arguments": ""}
                seen_start.add(call["index"])
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"} and call["function"]["arguments"]
    assert seen_start == {0, 1}
    assert [d["content"] for d in deltas if "content" in d] == list("Checking.")


def test_text_that_could_start_a_tag_is_held_back():
    p = Hermes()
    assert p.feed("Hello <tool_") == [{"content": "Hello"}]
    assert p.feed("ca") == []
    assert p.feed("r is here") == [{"content": " <tool_car is here"}]
    assert p.finish() == []
    p = Hermes()
    assert p.feed("Done. <") == [{"content": "Done."}]
    assert p.finish() == [{"content": " <"}]  # nothing came of it: it is content after all


def test_plain_text_is_all_content():
    for text in ["Hello, world.", "a < b and c > d", "  leading and trailing  ", "<tool_calls> is not the tag", "</tool_call> stray"]:
        assert raw(Hermes().extract(text)) == (text, [])
        _, got = streamed(text, [1] * len(text))
        assert raw(got) == (text, [])


@pytest.mark.parametrize("text", [
    "x <tool_call>not json</tool_call> y",
    'Try: <tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    '<tool_call>{"name": "f", "argu',
])
def test_malformed_tags_stay_content(text):
    whole = Hermes().extract(text)
    assert raw(whole) == (text, [])
    for seed in range(5):
        rng = random.Random(seed)
        _, got = streamed(text, [rng.randint(1, 4) for _ in text])
        assert raw(got) == (text, [])


def test_other_shapes_and_truncation():
    # keys in the other order, or "parameters": parsed whole, still a call
    got = Hermes().extract('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert plain(got) == (None, [("f", {"a": 1})])
    got = Hermes().extract('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    assert plain(got) == (None, [("f", {"a": 1})])
    # cut off by max_tokens: the call keeps what it has (OpenAI: arguments may be invalid JSON)
    got = Hermes().extract('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    assert raw(got) == (None, [("f", '{"a": [1, 2')])
    # a closed call without its closing tag is still a call, and text after calls is content
    got = Hermes().extract('<tool_call>{"name": "f", "arguments": {}}\n</tool_call>\n\nThat is all.')
    assert raw(got) == ("That is all.", [("f", "{}")])


def test_max_calls_keeps_the_first():
    text = hermes_text("", [("a", {"i": 1}), ("b", {"i": 2}), ("c", {})])
    assert plain(Hermes(max_calls=1).extract(text)) == (None, [("a", {"i": 1})])
    _, got = streamed(text, [3] * len(text), max_calls=1)
    assert plain(got) == (None, [("a", {"i": 1})])


def test_registry_and_plugin(tmp_path):
    assert "hermes" in tool_parser_names()
    with pytest.raises(KeyError):
        get_tool_parser("no-such-parser")
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from shoal.runtime.entrypoints.tool_parsers import ToolParser, register_tool_parser\n"
        "@register_tool_parser('shout')\n"
        "class Shout(ToolParser):\n"
        "    def feed(self, text):\n"
        "        return [{'content': text.upper()}] if text else []\n")
    load_tool_parser_plugin(str(plugin))
    assert get_tool_parser("shout")().extract("hi").content == "HI"


# -- tool_choice: checks, forcing schemas, conversions -----------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"], "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def request(**kw):
    kw.setdefault("messages", [])
    kw.setdefault("tools", None)
    kw.setdefault("tool_choice", None)
    kw.setdefault("parallel_tool_calls", None)
    return types.SimpleNamespace(**kw)


def test_required_schema_accepts_calls_and_refuses_others():
    choice = tool_choice_of(request(tools=[WEATHER, TIME, NOARGS], tool_choice="required"), None, False)
    schema = choice.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": "CET"}},
          {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {"zone": "PST"}}], [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tool_choice_of(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None, False).schema()
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[:2], one)


def test_named_schema_is_the_parameters_and_is_forced():
    choice = tool_choice_of(request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), None, False)
    assert choice.schema() == TIME["function"]["parameters"]
    assert choice.forced().json == TIME["function"]["parameters"]
    auto = tool_choice_of(request(tools=[WEATHER], tool_choice="auto"), "hermes", True)
    assert auto.forced() is None


@pytest.mark.parametrize("kw,param", [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "retrieval"}], tool_choice="none"), "tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER]), "tool_choice"),  # left out: "auto", which this server was not started for
])
def test_bad_tool_requests_are_400(kw, param):
    with pytest.raises(APIError) as e:
        tool_choice_of(request(**kw), None, False)
    assert e.value.status == 400 and e.value.param == param


def test_auto_and_none():
    assert tool_choice_of(request(), None, False) is None
    assert tool_choice_of(request(tools=[WEATHER], tool_choice="none"), None, False).template_tools is None
    auto = tool_choice_of(request(tools=[WEATHER]), "hermes", True)
    assert auto.mode == "auto" and auto.template_tools == [WEATHER] and auto.max_calls is None
    assert tool_choice_of(request(tools=[WEATHER], parallel_tool_calls=False), "hermes", True).max_calls == 1


def test_forced_output_becomes_tool_calls():
    required = ToolOutput(tool_choice_of(request(tools=[WEATHER, TIME], tool_choice="required"), None, False))
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": "UTC"}}])
    message, finish = required.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    single = ToolOutput(tool_choice_of(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None, False))
    assert len(single.message(text, "stop")[0]["tool_calls"]) == 1
    assert required.message("not json", "length") == ({"role": "assistant", "content": "not json"}, "length")
    named = ToolOutput(tool_choice_of(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None, False))
    message, finish = named.message('{"city": "Oslo"}', "stop")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    s = named.stream(0)
    deltas = s.feed('{"city"') + s.feed(': "Oslo"}') + s.finish()
    assert assemble(deltas).tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


# -- the chat template -------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
]


def test_builtin_template_ignores_tools_so_hermes_renders_them(tokenizer):
    assert not renders_tools(tokenizer, tokenizer.chat_template)
    template = tool_template(tokenizer, tokenizer.chat_template)
    assert template == hermes_template() and renders_tools(tokenizer, template)
    text = tokenizer.apply_chat_template(template_messages(CONVERSATION), tools=[WEATHER, TIME], chat_template=template,
                                         tokenize=False, add_generation_prompt=True)
    for tool in (WEATHER, TIME):  # every tool, whole, in the system turn
        assert json.dumps(tool, ensure_ascii=False) in text
    assert "<tool_response>\n22 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the assistant's call round-trips: the parser reads back what the template wrote
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert plain(Hermes().extract(turn)) == (None, [("get_weather", {"city": "Paris", "unit": "c"})])


def test_a_template_that_renders_tools_is_kept(tokenizer):
    own = "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert tool_template(tokenizer, own) == own


def test_llm_chat_passes_tools_to_the_template(tokenizer):
    from shoal.runtime.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)  # no engine: capture the prompts handed to generate
    llm.engine = types.SimpleNamespace(tokenizer=tokenizer)
    llm.generate = lambda prompts, params, use_tqdm: prompts
    (with_tools,) = llm.chat(CONVERSATION[:1], tools=[WEATHER])
    text = tokenizer.decode(with_tools)
    assert '"name": "get_weather"' in text and "<tools>" in text
    (round_trip,) = llm.chat(CONVERSATION, tools=[WEATHER])
    assert "<tool_call>" in tokenizer.decode(round_trip) and "22 degrees" in tokenizer.decode(round_trip)
    (without,) = llm.chat(CONVERSATION[:1])  # no tools: the model's own template, untouched
    assert tokenizer.decode(without) == tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)


def test_forcing_schemas_compile_in_xgrammar():
    """The grammar engine reads the schemas as jsonschema does (skipped where xgrammar is not installed)."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = [WEATHER, TIME, NOARGS]
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "get_time", "parameters": {"zone": "UTC"}},
            {"name": "ping", "parameters": {}}]
    bad = [[], [{"name": "nope", "parameters": {}}], [{"name": "get_time", "parameters": {"zone": "PST"}}]]
    for parallel in (True, False):
        schema = tool_choice_of(request(tools=tools, tool_choice="required", parallel_tool_calls=parallel), None, False).schema()
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        for call in good:
            assert accepts(grammar, json.dumps([call]))
        assert accepts(grammar, json.dumps(good[:2])) == parallel
        for value in bad:
            assert not accepts(grammar, json.dumps(value))


def test_serve_flags(tmp_path):
    import argparse

    from shoal.runtime.entrypoints.serve_args import _check_tool_flags, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def check(*argv):
        _check_tool_flags(parser.parse_args(list(argv)))

    check("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        check("--enable-auto-tool-choice")
    with pytest.raises(SystemExit, match="known parsers"):
        check("--tool-call-parser", "no-such")
    plugin = tmp_path / "plug.py"
    plugin.write_text("from shoal.runtime.entrypoints.tool_parsers import ToolParser, register_tool_parser\n"
                      "register_tool_parser('plugged')(type('Plugged', (ToolParser,), {}))\n")
    check("--tool-parser-plugin", str(plugin), "--tool-call-parser", "plugged")
