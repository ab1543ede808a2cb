"""Reasoning parsers without a server: qwen3 and deepseek_r1 split the thinking from the answer
as vLLM does, whole and streamed; every chunking adds up to the whole answer; the prompt's end
and Qwen3's enable_thinking decide whether the output starts inside the think block; the
output layer routes the answer (only) through the tool-call parser."""

from __future__ import annotations

import json
import random

import pytest

from shoal.runtime.entrypoints.reasoning_parsers import get_reasoning_parser, reasoning_parser_names
from shoal.runtime.entrypoints.reasoning_parsers.output import ChatOutput
from shoal.runtime.entrypoints.tool_parsers.choice import ToolChoice
from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput
from shoal.runtime.entrypoints.tool_parsers.registry import get_tool_parser

NAMES = ["qwen3", "deepseek_r1"]
PIECES = ["Let me think.", "\n", " ", "<", "</", "</thin", "think>", "<th", "a < b > c", "</think", "ünï", "<think", "x"]


def vllm_whole(text: str) -> tuple[str | None, str | None]:
    """vLLM's non-streaming rule, transcribed (basic_parsers.BaseThinkingReasoningParser /
    Qwen3's with thinking on): drop the first <think> and what precedes it, split at the
    first </think>; no </think>: all reasoning."""
    head, tag, tail = text.partition("<think>")
    body = tail if tag else head
    if "</think>" not in body:
        return body or None, None
    reasoning, _, content = body.partition("</think>")
    return reasoning or None, content or None


def random_text(rng: random.Random) -> tuple[str, str, str | None]:
    """(text, reasoning, content or None when the block never closes): a model's output."""
    reasoning = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
    while "<think>" in reasoning or "</think>" in reasoning:
        reasoning = reasoning.replace("</think>", "").replace("<think>", "")
    content = "".join(rng.choice(PIECES + ["<think>", "</think>"]) for _ in range(rng.randint(0, 8)))
    opening = rng.choice(["", "<think>", "<think>\n"])
    closed = rng.random() < 0.8
    text = opening + reasoning + ("</think>" + content if closed else "")
    return text, (opening[len("<think>"):] if opening else "") + reasoning, content if closed else None


def streamed(parser, text: str, sizes) -> tuple[str | None, str | None, list[dict]]:
    deltas, i = [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas += parser.feed(text[i:i + size])
        i += size
    deltas += parser.feed(text[i:]) + parser.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return reasoning or None, content or None, deltas


@pytest.mark.parametrize("name", NAMES)
def test_every_chunking_gives_the_whole_answer(name):
    parser_cls = get_reasoning_parser(name)
    rng = random.Random(11)
    for _ in range(300):
        text, reasoning, content = random_text(rng)
        whole = parser_cls().extract(text)
        assert whole == (reasoning or None, content or None), text
        if text.startswith("<think>") or "<think>" not in text:  # vLLM's rule drops text before a later <think>
            assert whole == vllm_whole(text), text
        for sizes in ([1] * len(text), [rng.randint(1, 5) for _ in text], [rng.randint(1, 12) for _ in text]):
            r, c, deltas = streamed(parser_cls(), text, sizes)
            assert (r, c) == whole, (text, sizes)
            assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)  # one non-empty part per delta


def test_held_back_tags_and_examples():
    p = get_reasoning_parser("deepseek_r1")()
    assert p.feed("<think>\nHmm <") == [{"reasoning_content": "\nHmm "}]
    assert p.feed("/thi") == []
    assert p.feed("nk>\n\nThe answer") == [{"content": "\n\nThe answer"}]
    assert p.finish() == []
    p = get_reasoning_parser("qwen3")()
    assert p.feed("a <b") == [{"reasoning_content": "a <b"}]  # "<b" can start no tag
    assert get_reasoning_parser("qwen3")().extract("thinking, cut off by max_tokens") == ("thinking, cut off by max_tokens", None)
    assert get_reasoning_parser("qwen3")().extract("<think>\n\n</think>\n\nHello") == ("\n\n", "\n\nHello")
    # a tail that looked like a tag but was not: given back at the end, to the part it was in
    p = get_reasoning_parser("qwen3")()
    assert p.feed("4 </th") == [{"reasoning_content": "4 "}] and p.finish() == [{"reasoning_content": "</th"}]


@pytest.mark.parametrize("name", NAMES)
def test_not_thinking_is_all_content(name):
    parser_cls = get_reasoning_parser(name)
    text = "Hello </think> <think> there"
    assert parser_cls(thinking=False).extract(text) == (None, text)
    _, content, _ = streamed(parser_cls(thinking=False), text, [1] * len(text))
    assert content == text


def test_starts_thinking_from_the_prompt_and_the_kwargs():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    closed = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    opened = "<|im_start|>assistant\n<think>\n"
    plain = "<|im_start|>assistant\n"
    for cls in (qwen3, r1):
        assert not cls.starts_thinking(closed, None)
        assert cls.starts_thinking(opened, None) and cls.starts_thinking(plain, {})
        assert cls.starts_thinking("user asked about </think> in a message\n<|im_start|>assistant\n", None)
    assert not qwen3.starts_thinking(plain, {"enable_thinking": False})
    assert qwen3.starts_thinking(plain, {"enable_thinking": True})
    assert r1.starts_thinking(plain, {"enable_thinking": False})  # R1 has no switch
    assert set(NAMES) <= set(reasoning_parser_names())


def test_output_routes_the_answer_through_the_tool_parser():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    # a call written inside the thinking is thinking, not a call (vLLM parses tools in the content only)
    text = f"<think>maybe <tool_call>{json.dumps(call)}</tool_call>?</think>\n\nChecking.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    out = ChatOutput(get_reasoning_parser("qwen3"), True, ToolOutput(ToolChoice("auto", tools, parser=get_tool_parser("hermes"))))
    message, finish = out.message(text, "stop")
    assert finish == "tool_calls"
    assert message["reasoning_content"] == message["reasoning"] == f"maybe <tool_call>{json.dumps(call)}</tool_call>?"
    assert message["content"] == "\n\nChecking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [("get_weather", call["arguments"])]
    rng = random.Random(3)
    for _ in range(20):  # streamed, any chunking: the same message
        s, deltas, i = out.stream(rng.random()), [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            deltas += s.feed(text[i:i + k])
            i += k
        deltas += s.finish()
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
        assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning_content" in d)
    hidden = ChatOutput(get_reasoning_parser("deepseek_r1"), True, None, include_reasoning=False)
    message, finish = hidden.message("secret</think>shown", "length")
    assert message == {"role": "assistant", "content": "shown"} and finish == "length"


def test_serve_flag():
    import argparse

    from shoal.runtime.entrypoints.serve_args import _check_reasoning_flags, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name in NAMES:
        _check_reasoning_flags(parser.parse_args(["--reasoning-parser", name]))
    assert parser.parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit, match="known parsers"):
        _check_reasoning_flags(parser.parse_args(["--reasoning-parser", "no-such"]))
    with pytest.raises(SystemExit):  # vLLM removed --enable-reasoning (0.10): the parser alone turns it on
        parser.parse_args(["--enable-reasoning"])
