"""The response side of tool calling: one choice's generated text turned into an assistant
message with tool_calls (whole) or into OpenAI delta chunks (streamed); the same code
for both, so a stream adds up to the whole answer.

    auto      the --tool-call-parser parser
    named     the text is the arguments object (structured outputs forced it): the call
              starts with the first text and the text streams as its arguments
    required  the text is a JSON array of {"name", "parameters"}: parsed when it is whole
              (a stream gets the calls at its end); text that does not parse stays content
finish_reason "stop" becomes "tool_calls" when the message holds calls ("length" stays).
"""

from __future__ import annotations

import json

from shoal.runtime.entrypoints.tool_parsers.base import ExtractedToolCalls, assemble, call_arguments, call_start, coalesce
from shoal.runtime.entrypoints.tool_parsers.choice import ToolChoice


class _Named:
    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        return self.finish() + [call_arguments(0, text)]

    def finish(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        return [call_start(0, self.name)]


class _Required:
    def __init__(self, names: set[str], max_calls: int | None):
        self.names, self.max_calls, self.text = names, max_calls, []

    def feed(self, text: str) -> list[dict]:
        self.text.append(text)
        return []

    def finish(self) -> list[dict]:
        text = "".join(self.text)
        try:
            calls = json.loads(text)
        except ValueError:
            calls = None
        ok = isinstance(calls, list) and calls and all(
            isinstance(c, dict) and c.get("name") in self.names and isinstance(c.get("parameters", {}), dict) for c in calls)
        if not ok:
            return [{"content": text}] if text else []
        out = []
        for i, c in enumerate(calls[: self.max_calls]):
            out += [call_start(i, c["name"]), call_arguments(i, json.dumps(c.get("parameters", {}), ensure_ascii=False))]
        return out


class ChoiceStream:
    """One choice: `feed(text)` and `finish()` give OpenAI deltas; `called` once a call started."""

    def __init__(self, choice: ToolChoice, tokenizer=None):
        if choice.mode == "auto":
            self.impl = choice.parser(tokenizer, max_calls=choice.max_calls)
        elif choice.mode == "named":
            self.impl = _Named(choice.function)
        elif choice.mode == "required":
            self.impl = _Required({t["function"]["name"] for t in choice.tools}, choice.max_calls)
        else:
            self.impl = None
        self.called = False

    def _seen(self, deltas: list[dict]) -> list[dict]:
        self.called = self.called or any("tool_calls" in d for d in deltas)
        return deltas

    def feed(self, text: str) -> list[dict]:
        if self.impl is None:
            return [{"content": text}] if text else []
        return self._seen(coalesce(self.impl.feed(text)))

    def finish(self) -> list[dict]:
        return [] if self.impl is None else self._seen(coalesce(self.impl.finish()))

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" else reason


class ToolOutput:
    """One request's tool choice on the response side: a ChoiceStream per streamed choice."""

    def __init__(self, choice: ToolChoice, tokenizer=None):
        self.choice, self.tokenizer = choice, tokenizer
        self.streams: dict[int, ChoiceStream] = {}

    def stream(self, index: int) -> ChoiceStream:
        s = self.streams.get(index)
        if s is None:
            s = self.streams[index] = ChoiceStream(self.choice, self.tokenizer)
        return s

    def extract(self, text: str) -> tuple[ExtractedToolCalls, ChoiceStream]:
        s = ChoiceStream(self.choice, self.tokenizer)
        return assemble(s.feed(text) + s.finish()), s

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole choice: (the assistant message, its finish_reason)."""
        if self.choice.mode == "none":
            return {"role": "assistant", "content": text}, finish_reason
        got, s = self.extract(text)
        message = {"role": "assistant", "content": got.content}
        if got.tool_calls:
            message["tool_calls"] = got.tool_calls
        return message, s.finish_reason(finish_reason)
