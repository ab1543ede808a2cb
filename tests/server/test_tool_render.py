"""The serving layer's conversion on known text: a Job fed the engine's outputs for a text that
holds Hermes tool calls, rendered whole and streamed by the real Renderer; the official
`openai` types validate every body and chunk, and its own stream accumulator adds the chunks
up to the same message (content, tool_calls, finish_reason "tool_calls"), for any chunking."""

from __future__ import annotations

import json
import random
import types

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from shoal.runtime.engine.async_engine import Output
from shoal.runtime.engine.request import CompletionOutput
from shoal.runtime.entrypoints.job import Job
from shoal.runtime.entrypoints.openai_render import Renderer
from shoal.runtime.entrypoints.tool_parsers.choice import tool_choice_of
from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
CALLS = [("get_weather", {"city": "Paris", "note": 'say "}" </tool_call>'}), ("get_time", {"zone": "CET"})]
TEXT = "Let me check both.\n" + "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS)


def make_job(texts: dict[int, str], seed: int, finish: str = "stop") -> Job:
    """A Job with one engine request, n choices, each text cut into random 'tokens'."""
    state = types.SimpleNamespace(model_name="m", engine=types.SimpleNamespace(abort=lambda rid: None), tok_str=str)
    job = Job(state, "chatcmpl-test", len(texts))
    job.rids, job.unfinished = ["r-0"], {"r-0"}
    rng = random.Random(seed)
    pieces = {i: [] for i in texts}
    for i, text in texts.items():
        pos = 0
        while pos < len(text):
            k = rng.randint(1, 6)
            pieces[i].append(text[pos:pos + k])
            pos += k
    steps = max(len(p) for p in pieces.values())
    for step in range(steps):
        deltas = []
        for i, p in pieces.items():
            if step < len(p):
                last = step == len(p) - 1
                deltas.append(CompletionOutput(i, p[step], [step], None, None, finish if last else None))
        job.queue.put_nowait(Output("r-0", 0, deltas, step == steps - 1, num_prompt_tokens=7 if step == 0 else 0))
    return job


def tool_output(**kw) -> ToolOutput:
    req = types.SimpleNamespace(messages=[], tools=TOOLS, tool_choice="auto", parallel_tool_calls=None)
    for k, v in kw.items():
        setattr(req, k, v)
    return ToolOutput(tool_choice_of(req, "hermes", True))


async def whole(texts, seed=0, finish="stop", **kw) -> ChatCompletion:
    job = make_job(texts, seed, finish)
    while job.unfinished:
        job.apply(job.queue.get_nowait())
    return ChatCompletion.model_validate(Renderer(job.state, job, 0, chat=True, logprobs=None, tools=tool_output(**kw)).body())


async def streamed(texts, seed=0, finish="stop", **kw) -> tuple[list[ChatCompletionChunk], object]:
    job = make_job(texts, seed, finish)
    response = Renderer(job.state, job, 0, chat=True, logprobs=None, include_usage=True, tools=tool_output(**kw)).stream([])
    raw = "".join([part async for part in response.body_iterator])
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    acc = ChatCompletionStreamState()
    for c in chunks:
        acc.handle_chunk(c)
    return chunks, acc.current_completion_snapshot


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def test_whole_body_has_tool_calls():
    out = await whole({0: TEXT})
    c = out.choices[0]
    assert c.message.content == "Let me check both." and calls(c.message) == CALLS and c.finish_reason == "tool_calls"
    assert all(tc.id.startswith("chatcmpl-tool-") and tc.type == "function" for tc in c.message.tool_calls)
    assert out.usage.prompt_tokens == 7


@pytest.mark.parametrize("seed", range(4))
async def test_stream_adds_up_to_the_body(seed):
    chunks, snap = await streamed({0: TEXT}, seed)
    c = snap.choices[0]
    assert c.message.content == "Let me check both." and calls(c.message) == CALLS and c.finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 7
    starts = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or [] if tc.id]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in starts] == [(0, "get_weather", ""), (1, "get_time", "")]
    assert all("<tool" not in (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)


async def test_parallel_tool_calls_false_returns_one():
    out = await whole({0: TEXT}, parallel_tool_calls=False)
    assert calls(out.choices[0].message) == CALLS[:1]
    _, snap = await streamed({0: TEXT}, 3, parallel_tool_calls=False)
    assert calls(snap.choices[0].message) == CALLS[:1]


async def test_n2_plain_and_calls_side_by_side_and_length_stays():
    texts = {0: TEXT, 1: "No tools needed: 2 < 3."}
    out = await whole(texts, 1)
    by = {c.index: c for c in out.choices}
    assert calls(by[0].message) == CALLS and by[0].finish_reason == "tool_calls"
    assert by[1].message.content == texts[1] and not by[1].message.tool_calls and by[1].finish_reason == "stop"
    _, snap = await streamed(texts, 1)
    sby = {c.index: c for c in snap.choices}
    assert calls(sby[0].message) == CALLS and sby[1].message.content == texts[1] and sby[1].finish_reason == "stop"
    cut = await whole({0: TEXT[:-20]}, finish="length")  # cut off inside the second call: "length" stays
    assert cut.choices[0].finish_reason == "length"
    assert [t.function.name for t in cut.choices[0].message.tool_calls] == ["get_weather", "get_time"]
