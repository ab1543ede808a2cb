"""The official `openai` client against a real `shoal serve`: completions and chat, streamed
and not, n=2, stop strings, logprobs, seeded sampling; greedy streams equal the full answer."""

from __future__ import annotations

import math

import openai
import pytest

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models(client, server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "smollm2-135m-instruct"
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_completion_greedy_stream_equals_full(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == model_name

    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_stream_equals_full(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.usage.prompt_tokens > len(CHAT[0]["content"].split())  # the template adds tokens

    stream = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n2_completions_and_chat(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}))
    by_index = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            by_index[ch.index] += ch.text
    assert by_index == {c.index: c.text for c in out.choices}  # same seed, same samples


def test_seeded_sampling_reproducible(client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=1.0, top_p=0.95, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    c = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=1.0, seed=7).choices[0].message.content
    d = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=1.0, seed=7).choices[0].message.content
    assert c == d


def test_stop_strings(client, model_name):
    base = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 2, base
    stop = words[1]
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    ch = out.choices[0]
    assert ch.finish_reason == "stop"
    assert stop not in ch.text and base.startswith(ch.text)
    assert ch.model_extra.get("stop_reason") == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == ch.text


def test_completion_logprobs(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and math.isfinite(val)
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy: the chosen token is the top one
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    plain = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_extra_sampling_fields(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=5,
        extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 6, "repetition_penalty": 1.1, "ignore_eos": True, "priority": 0},
    )
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_batch_prompts_and_token_ids(client, model_name):
    out = client.completions.create(model=model_name, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(model=model_name, prompt="Goodbye", max_tokens=3, temperature=0)
    assert out.choices[1].text == single.choices[0].text
    ids = client.completions.create(model=model_name, prompt=[1, 2, 3, 4], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 4
    echo = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello")


def test_errors_have_openai_shape(client, model_name):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=1, temperature=-1)
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[10**9], max_tokens=1)
    assert "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, stream=True, top_logprobs=30, logprobs=True)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # too long for max_model_len
        client.completions.create(model=model_name, prompt=[5] * 5000, max_tokens=1)
    assert "max_model_len" in e.value.body["message"]
