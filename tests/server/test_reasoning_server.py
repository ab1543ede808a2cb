"""Reasoning through the server. The real Renderer on a fake engine's output (any chunking):
reasoning_content in the body and in the chunks, validated by the `openai` types. Then a real
`shoal serve --reasoning-parser qwen3` on a tiny random model given a Qwen3-style chat template,
read with the official `openai` client: a random model never writes `</think>` by itself, so
structured outputs (a regex) force the text; the answer must come back split, whole and
streamed; chat_template_kwargs {"enable_thinking": false} must reach the template (the prompt
ends with the empty think block, as /tokenize shows) and turn the same text into content."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from engine_helpers import make_tiny_model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from server_helpers import served
from test_tool_render import make_job

from shoal.runtime.entrypoints.reasoning_parsers import get_reasoning_parser
from shoal.runtime.entrypoints.reasoning_parsers.output import ChatOutput
from shoal.runtime.entrypoints.openai_render import Renderer

THINKING, ANSWER = "\nTwo and two, so four.\n", "\n\nThe answer is 4."
TEXT = f"<think>{THINKING}</think>{ANSWER}"

# Qwen3's shape: ChatML, and with enable_thinking false an empty think block ends the prompt
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def output(thinking=True, include=True) -> ChatOutput:
    return ChatOutput(get_reasoning_parser("qwen3"), thinking, None, include_reasoning=include)


def render_whole(texts, out, seed=0, finish="stop") -> ChatCompletion:
    job = make_job(texts, seed, finish)
    while job.unfinished:
        job.apply(job.queue.get_nowait())
    return ChatCompletion.model_validate(Renderer(job.state, job, 0, chat=True, logprobs=None, tools=out).body())


async def render_stream(texts, out, seed=0) -> list[ChatCompletionChunk]:
    job = make_job(texts, seed)
    response = Renderer(job.state, job, 0, chat=True, logprobs=None, tools=out).stream([])
    raw = "".join([part async for part in response.body_iterator])
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]


def joined(chunks, index: int, field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks if c.choices and c.choices[0].index == index)


def test_body_splits_the_thinking():
    msg = render_whole({0: TEXT, 1: "still thinking when cut off"}, output(), finish="length").choices
    assert (msg[0].message.reasoning_content, msg[0].message.content) == (THINKING, ANSWER)
    assert msg[0].message.model_extra["reasoning"] == THINKING
    assert (msg[1].message.reasoning_content, msg[1].message.content) == ("still thinking when cut off", None)
    plain = render_whole({0: TEXT}, output(thinking=False)).choices[0].message
    assert (plain.reasoning_content, plain.content) == (None, TEXT)
    hidden = render_whole({0: TEXT}, output(include=False)).choices[0].message
    assert hidden.content == ANSWER and "reasoning_content" not in hidden.model_extra


@pytest.mark.parametrize("seed", range(4))
async def test_stream_splits_the_thinking(seed):
    chunks = await render_stream({0: TEXT, 1: TEXT}, output(), seed)
    for index in (0, 1):
        assert joined(chunks, index, "reasoning_content") == THINKING
        assert joined(chunks, index, "reasoning") == THINKING
        assert joined(chunks, index, "content") == ANSWER
    assert all("think>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


# -- a real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-reasoning"), builtin_dir)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_STYLE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)  # the template file would win over the config's
    with served([str(path), "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--reasoning-parser", "qwen3"]) as s:
        yield s


@pytest.fixture(scope="module")
def oai(reasoning_server):
    return reasoning_server.openai()


ASK = [{"role": "user", "content": "What is 2 + 2?"}]
# the regex that makes the random model write TEXT, exactly
FORCE = {"structured_outputs": {"regex": r"\n".join(re.escape(line) for line in TEXT.split("\n"))}, "temperature": 0}


def test_http_reasoning_content_whole_and_streamed(oai):
    model = oai.models.list().data[0].id
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=64, extra_body=FORCE)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (THINKING, ANSWER), m
    stream = oai.chat.completions.create(model=model, messages=ASK, max_tokens=64, stream=True, extra_body=FORCE)
    chunks = list(stream)
    assert joined(chunks, 0, "reasoning_content") == THINKING and joined(chunks, 0, "content") == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_http_enable_thinking_false_reaches_the_template(oai, reasoning_server):
    model = oai.models.list().data[0].id
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(reasoning_server.base_url + "/tokenize", json=body, timeout=60).json()["tokens"]
    text = httpx.post(reasoning_server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), text
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=64, extra_body=dict(FORCE, chat_template_kwargs={"enable_thinking": False}))
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (None, TEXT)


@pytest.mark.parametrize("kwargs,needle", [("yes", "chat_template_kwargs"), ([1], "chat_template_kwargs"),
                                           ({"tokenize": True}, "tokenize"), ({"add_generation_prompt": False}, "add_generation_prompt")])
def test_http_bad_chat_template_kwargs_are_400(reasoning_server, kwargs, needle):
    r = httpx.post(reasoning_server.v1 + "/chat/completions", json={"messages": ASK, "max_tokens": 2, "chat_template_kwargs": kwargs}, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.text
    assert httpx.get(reasoning_server.base_url + "/health", timeout=10).status_code == 200
