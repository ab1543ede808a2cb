"""tool_choice "required" and a named function, forced with structured outputs (a JSON schema
on SamplingParams.structured_outputs that the grammar engine enforces): even a tiny
random-weight model must return calls whose arguments validate (jsonschema) against the
function's parameters, streamed and not, and parallel_tool_calls: false gives exactly one.

Needs the grammar engine in the engine (xgrammar acting on structured_outputs); without it
the model's text is unconstrained and these fail. The schemas are small and closed (enums,
booleans) so a random model under the grammar finishes well within max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_helpers import make_tiny_model
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_helpers import served

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm", "parameters": {
    "type": "object", "properties": {"day": {"$ref": "#/$defs/day"}, "loud": {"type": "boolean"}},
    "required": ["day", "loud"], "additionalProperties": False, "$defs": {"day": {"enum": ["mon", "tue", "wed"]}}}}}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Wake me on Tuesday if it rains in Oslo."}]
KW = dict(max_tokens=160, temperature=0)


@pytest.fixture(scope="module")
def oai(tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-forced"), builtin_dir)
    with served([str(path), "--max-num-seqs", "8", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]) as s:
        yield s.openai()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def check_calls(choice, names: set[str]) -> list:
    calls = choice.message.tool_calls or []
    assert calls, f"no tool calls: {choice.message.content!r} ({choice.finish_reason})"
    assert choice.finish_reason == "tool_calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_named_function(oai, model):
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    out = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, **KW)
    (call,) = check_calls(out.choices[0], {"set_alarm"})
    state = ChatCompletionStreamState()
    for chunk in oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, stream=True, **KW):
        state.handle_chunk(chunk)
    (streamed,) = check_calls(state.current_completion_snapshot.choices[0], {"set_alarm"})
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)  # greedy: the same call


def test_required_one_call(oai, model):
    out = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **KW)
    assert len(check_calls(out.choices[0], set(SCHEMAS))) == 1


def test_required_streamed(oai, model):
    state = ChatCompletionStreamState()
    for chunk in oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", stream=True,
                                             parallel_tool_calls=False, **KW):
        state.handle_chunk(chunk)
    assert len(check_calls(state.current_completion_snapshot.choices[0], set(SCHEMAS))) == 1
