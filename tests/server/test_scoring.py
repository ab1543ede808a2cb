"""Scoring prompts over HTTP as evaluation harnesses do (echo + logprobs, max_tokens 0,
prompt_logprobs) and vLLM's token extras (truncate_prompt_tokens, return_token_ids,
return_tokens_as_token_ids), with the official `openai` client against a real
`shoal serve` subprocess on a tiny random Llama; transformers on the same weights is the
reference for every log-probability."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from server_helpers import served

BUDGET = 64  # the server's step budget: the long prompts here are prefilled in chunks
LONG = [(11 * i + 5) % 30000 + 20 for i in range(150)]
CHAT = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-scoring-server"), builtin_dir)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with served([str(tiny_dir), "--max-num-batched-tokens", str(BUDGET), "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def h(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """ids -> [len(ids), V]: row p is transformers' log-distribution of token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def log_softmax(ids):
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return log_softmax


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from shoal.runtime.models.loader import load_tokenizer

    return load_tokenizer(tiny_dir)


def assert_prompt_logprobs(field: list, ids: list[int], ref_rows: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs: [null, {"id": {logprob, rank, decoded_token}}, ...]."""
    assert len(field) == len(ids) and field[0] is None
    for p in range(1, len(ids)):
        row, entry = ref_rows[p - 1], field[p]
        mine = entry[str(ids[p])]
        assert mine["logprob"] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        value = row[ids[p]].item()
        assert int((row > value + 1e-4).sum()) + 1 <= mine["rank"] <= int((row >= value - 1e-4).sum())
        top = set(row.topk(k).indices.tolist())
        assert {int(t) for t, e in entry.items() if e["rank"] <= k} <= top | {ids[p]}
        assert len(entry) in (k, k + 1) and all(isinstance(e["decoded_token"], str) for e in entry.values())


def assert_alive(h):
    r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_echo_max_tokens_zero_is_a_loglikelihood_request(client, ref, tok):
    """lm-evaluation-harness's loglikelihood: echo, max_tokens 0, logprobs 1 -> the prompt's
    logprobs alone (null for the first token), is_greedy from top_logprobs."""
    text = tok.decode(LONG)
    ids = tok(text).input_ids
    out = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = out.choices[0]
    assert c.text == text and c.finish_reason == "length"
    lp, rows = c.logprobs, ref(ids)
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(rows[p - 1, ids[p]].item(), abs=1e-4)
        greedy = int(rows[p - 1].argmax())
        assert lp.top_logprobs[p][tok.decode([greedy])] == pytest.approx(rows[p - 1, greedy].item(), abs=1e-4)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.text_offset[0] == 0 and all(b - a == len(s) for a, b, s in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def test_echo_with_logprobs_then_the_generated_tokens(client, ref):
    out = client.completions.create(model="tiny", prompt=LONG, max_tokens=3, echo=True, logprobs=2, temperature=0)
    lp, rows = out.choices[0].logprobs, ref(LONG)
    assert len(lp.token_logprobs) == len(LONG) + 3 == len(lp.tokens) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None
    for p in range(1, len(LONG)):
        assert lp.token_logprobs[p] == pytest.approx(rows[p - 1, LONG[p]].item(), abs=1e-4)
        assert len(lp.top_logprobs[p]) in (2, 3)
    plain = client.completions.create(model="tiny", prompt=LONG, max_tokens=3, logprobs=2, temperature=0).choices[0]
    assert lp.token_logprobs[len(LONG):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert out.choices[0].text.endswith(plain.text)


def test_prompt_logprobs_on_completions_per_choice(client, ref):
    out = client.completions.create(model="tiny", prompt=[LONG, LONG[:20]], max_tokens=2, n=2, temperature=0.7, seed=4,
                                    extra_body={"prompt_logprobs": 3})
    assert len(out.choices) == 4
    for c in out.choices:
        ids = LONG if c.index < 2 else LONG[:20]
        assert_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, ref(ids), 3)


def test_prompt_logprobs_and_token_ids_on_chat(client, ref):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                         extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    ids = out.model_extra["prompt_token_ids"]
    assert len(ids) == out.usage.prompt_tokens
    assert_prompt_logprobs(out.model_extra["prompt_logprobs"], ids, ref(ids), 2)
    assert len(out.choices[0].model_extra["token_ids"]) == out.usage.completion_tokens


def test_return_token_ids_and_tokens_as_ids(client, tok):
    body = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, logprobs=2, temperature=0, extra_body=body)
    c = out.choices[0]
    assert c.model_extra["prompt_token_ids"] == tok("Once upon a time").input_ids
    ids = c.model_extra["token_ids"]
    assert len(ids) == out.usage.completion_tokens and tok.decode(ids) == c.text
    assert c.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for d in c.logprobs.top_logprobs for k in d)
    # a stream hands the same ids, the prompt's once
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                            stream=True, extra_body=body))
    streamed = [t for ch in chunks for t in ch.choices[0].model_extra.get("token_ids") or []]
    assert streamed == ids
    assert [ch.choices[0].model_extra.get("prompt_token_ids") for ch in chunks if ch.choices[0].model_extra.get("prompt_token_ids")] \
        == [c.model_extra["prompt_token_ids"]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tok):
    out = client.completions.create(model="tiny", prompt=LONG, max_tokens=2, echo=True, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True})
    c = out.choices[0]
    assert out.usage.prompt_tokens == 10 and c.model_extra["prompt_token_ids"] == LONG[-10:]
    assert c.text.startswith(tok.decode(LONG[-10:]))
    same = client.completions.create(model="tiny", prompt=LONG[-10:], max_tokens=2, temperature=0)
    assert c.text == tok.decode(LONG[-10:]) + same.choices[0].text
    whole = client.completions.create(model="tiny", prompt=LONG, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(LONG)  # -1: max_model_len, more than the prompt


def test_a_stream_sends_the_prompt_part_first(client):
    """Streamed, each choice's first chunk holds the echo with its logprobs and
    prompt_logprobs (once the prompt is scored); the rest is what the body holds."""
    kw = dict(model="tiny", prompt=[LONG[:80], LONG[:30]], max_tokens=3, n=2, echo=True, logprobs=1, temperature=0,
              extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    body = client.completions.create(**kw)
    per_choice = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            per_choice.setdefault(c.index, []).append(c)
    assert sorted(per_choice) == [c.index for c in body.choices] == [0, 1, 2, 3]
    for want in body.choices:
        got = per_choice[want.index]
        assert "".join(c.text for c in got) == want.text
        assert got[0].model_extra["prompt_logprobs"] == want.model_extra["prompt_logprobs"]
        assert all(c.model_extra.get("prompt_logprobs") is None for c in got[1:])
        streamed = {name: [v for c in got if c.logprobs for v in getattr(c.logprobs, name)]
                    for name in ("tokens", "token_logprobs", "text_offset")}
        assert streamed["tokens"] == want.logprobs.tokens and streamed["text_offset"] == want.logprobs.text_offset
        assert streamed["token_logprobs"] == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
        assert got[-1].finish_reason == want.finish_reason
    # max_tokens 0: one chunk per choice, the prompt alone
    only = list(client.completions.create(model="tiny", prompt=LONG[:40], max_tokens=0, echo=True, logprobs=0, stream=True,
                                          stream_options={"include_usage": True}))
    texts = [c for ch in only for c in ch.choices]
    assert len(texts) == 1 and texts[0].finish_reason == "length" and len(texts[0].logprobs.tokens) == 40
    assert only[-1].usage.completion_tokens == 0 and only[-1].usage.prompt_tokens == 40


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": 1025}, "truncate_prompt_tokens"),
    ({"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"prompt": "Hi", "max_tokens": 1, "return_token_ids": 1}, "return_token_ids"),
    ({"messages": CHAT, "max_tokens": 1, "stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 1, "echo": True}, "echo"),
])
def test_refused_combinations_are_400(h, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = h.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert_alive(h)


def test_include_stop_str_in_output(client):
    plain = client.completions.create(model="tiny", prompt=LONG[:30], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    stop = text[len(text) // 2 :][:3].strip() or text[-1]
    cut = client.completions.create(model="tiny", prompt=LONG[:30], max_tokens=6, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    kept = client.completions.create(model="tiny", prompt=LONG[:30], max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True, "ignore_eos": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop
