"""What every tool-call parser is: one choice's generated text in, OpenAI deltas out.

A parser is fed the text as it arrives (`feed`) and told when it ends (`finish`); each call
returns OpenAI chat deltas, in order:
    {"content": "..."}                                                    plain text
    {"tool_calls": [{"index", "id", "type": "function",
                     "function": {"name", "arguments": ""}}]}             a call starts
    {"tool_calls": [{"index", "function": {"arguments": "..."}}]}         its arguments, in fragments
A whole response is the same machine fed once (`extract`), so a stream, however it is
chunked, adds up to exactly the non-streaming answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_start(index: int, name: str, call_id: str | None = None) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id or tool_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}]}


def call_arguments(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def coalesce(deltas: list[dict]) -> list[dict]:
    """Join neighbouring content deltas, and neighbouring argument fragments of one call
    (a call's start stays its own delta: id and name first, then the arguments)."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and "content" in d and "content" in prev:
            out[-1] = {"content": prev["content"] + d["content"]}
            continue
        if prev is not None and _fragment(d) is not None and _fragment(prev) is not None \
                and d["tool_calls"][0]["index"] == prev["tool_calls"][0]["index"]:
            out[-1] = call_arguments(d["tool_calls"][0]["index"], _fragment(prev) + _fragment(d))
            continue
        out.append(d)
    return [d for d in out if d.get("content", None) != "" and _fragment(d) != ""]


def _fragment(d: dict) -> str | None:
    calls = d.get("tool_calls")
    if calls and "id" not in calls[0]:
        return calls[0]["function"]["arguments"]
    return None


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's message.tool_calls entries

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


def assemble(deltas: list[dict]) -> ExtractedToolCalls:
    """The message a list of deltas adds up to."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for c in d.get("tool_calls", ()):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    text = "".join(content)
    return ExtractedToolCalls(text or None, [calls[i] for i in sorted(calls)])


def call_of(obj) -> tuple[str, dict] | None:
    """(name, arguments) when a parsed object is a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return (obj["name"], args) if isinstance(args, dict) else None


class ToolParser:
    """One choice's parser (a fresh instance per choice). `max_calls`: calls beyond it are
    parsed and dropped (parallel_tool_calls: false keeps one)."""

    name = ""
    keeps_special_tokens = False  # True: the format's markers are special tokens the text must keep (mistral)

    def __init__(self, tokenizer=None, max_calls: int | None = None):
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.calls = 0  # calls recognised (muted ones included)

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        return []

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole response at once (non-streaming); the parser is used up."""
        return assemble(self.feed(text) + self.finish())

    # -- the streamed calls' bookkeeping, for the parsers ------------------------------------
    def call_id(self) -> str | None:
        return None  # tool_call_id()

    def start_call(self, name: str, out: list[dict]) -> None:
        self.calls += 1
        if not self._muted():
            out.append(call_start(self.calls - 1, name, self.call_id()))

    def fragment(self, text: str, out: list[dict]) -> None:
        """More of the current call's arguments."""
        if text and not self._muted():
            out.append(call_arguments(self.calls - 1, text))

    def _muted(self) -> bool:
        return self.max_calls is not None and self.calls > self.max_calls
