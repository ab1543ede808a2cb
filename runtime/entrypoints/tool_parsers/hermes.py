"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, as Hermes, Qwen2.5 and the shipped template (hermes_tool_chat_template.jinja)
write them.

One state machine serves both modes (docs/tools.md):
  text      outside a tag: content. Text that could be the start of `<tool_call>` is held
            back, and so is whitespace that could precede one (whitespace around a call is
            dropped, the rest is kept, before, between and after calls).
  header    after `<tool_call>`: held until it reads `{"name": "<name>", "arguments": {`;
            then the call starts (index, id, name).
  arguments the arguments object, passed through as it arrives, up to its closing brace
            (JSON strings and nesting tracked), or `</tool_call>`, or the end (a truncated
            call keeps what it has, as OpenAI's arguments may be invalid JSON).
  tail      whatever follows the arguments up to `</tool_call>`: ignored.
  fallback  a header of another shape: the block is held to `</tool_call>` (or the end) and
            parsed whole; a JSON object with a name and object arguments is a call, anything
            else is left as content, tags included.
"""

from __future__ import annotations

import json

import regex

from shoal.runtime.entrypoints.streamed_parsers import held_suffix
from shoal.runtime.entrypoints.tool_parsers.base import ToolParser, call_of, coalesce
from shoal.runtime.entrypoints.tool_parsers.json_calls import JsonScanner
from shoal.runtime.entrypoints.tool_parsers.registry import register_tool_parser

START, END = "<tool_call>", "</tool_call>"
HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*\{', regex.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tokenizer=None, max_calls: int | None = None):
        super().__init__(tokenizer, max_calls)
        self.state = "text"
        self.pending = ""  # text not yet emitted (state text) or the call's body so far (other states)
        self.after_call = False  # drop whitespace right after a call
        self.ws_before = ""  # whitespace before the open tag: dropped for a call, kept for a malformed tag
        self.pos = 0  # arguments: where the scan of pending has reached
        self.scanner = JsonScanner(stop=END)

    # -- the machine -------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while getattr(self, f"_{self.state}")(out):
            pass
        return coalesce(out)

    def finish(self) -> list[dict]:
        out: list[dict] = []
        if self.state == "text":
            if self.pending and not self.after_call:
                out.append({"content": self.pending})
        elif self.state in ("header", "fallback"):
            self._whole_block(self.pending, closed=False, out=out)
        self.pending, self.state = "", "done"
        return coalesce(out)

    def _done(self, out) -> bool:
        self.pending = ""
        return False

    # each step returns True when it changed state and the loop should go on
    def _text(self, out) -> bool:
        if self.after_call:
            self.pending = self.pending.lstrip()
            if not self.pending:
                return False
            self.after_call = False
        i = self.pending.find(START)
        if i >= 0:
            before = self.pending[:i]
            kept = before.rstrip()
            self.ws_before = before[len(kept):]
            if kept:
                out.append({"content": kept})
            self.pending = self.pending[i + len(START):]
            self.state = "header"
            return True
        cut = len(self.pending) - held_suffix(self.pending, START)
        cut = len(self.pending[:cut].rstrip())
        if cut:
            out.append({"content": self.pending[:cut]})
            self.pending = self.pending[cut:]
        return False

    def _header(self, out) -> bool:
        m = HEADER.match(self.pending, partial=True)
        if m is not None and m.partial:
            return False  # may still become a header
        name = json.loads(m.group(1)) if m is not None else ""
        if not name:
            self.state = "fallback"
            return True
        self.start_call(name, out)
        self.pos = m.end() - 1  # the arguments' opening brace
        self.scanner = JsonScanner(stop=END)
        self.state = "arguments"
        return True

    def _arguments(self, out) -> bool:
        body, start = self.pending, self.pos
        end = self.scanner.scan(body, start)
        stop = self.scanner.stop_at  # the closing tag before the braces closed, or a tail that may be it
        pos = end if end >= 0 else stop if stop >= 0 else len(body)
        self.fragment(body[start:pos], out)
        self.pos = pos
        if stop >= 0 and body.startswith(END, stop):
            return self._close(stop + len(END))
        if end >= 0:
            self.pending = body[pos:]
            self.state = "tail"
            return True
        return False

    def _tail(self, out) -> bool:
        i = self.pending.find(END)
        if i < 0:
            keep = held_suffix(self.pending, END)
            self.pending = self.pending[len(self.pending) - keep:] if keep else ""
            return False
        return self._close(i + len(END))

    def _fallback(self, out) -> bool:
        i = self.pending.find(END)
        if i < 0:
            return False
        self._whole_block(self.pending[:i], closed=True, out=out)
        self.pending = self.pending[i + len(END):]
        self.state = "text"
        return True

    # -- pieces ------------------------------------------------------------------------------
    def _close(self, end: int) -> bool:
        self.pending = self.pending[end:]
        self.state, self.after_call = "text", True
        return True

    def start_call(self, name: str, out) -> None:
        self.ws_before = ""
        super().start_call(name, out)

    def _whole_block(self, block: str, closed: bool, out) -> None:
        """A block whose header was not the usual one: a call if it parses, else content."""
        try:
            call = call_of(json.loads(block))
        except ValueError:
            call = None
        if call is not None:
            self.start_call(call[0], out)
            self.fragment(json.dumps(call[1], ensure_ascii=False), out)
            self.after_call = True
            return
        out.append({"content": self.ws_before + START + block + (END if closed else "")})
        self.ws_before = ""
