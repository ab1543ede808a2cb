"""Calls written as JSON objects, `{"name": ..., "arguments": {...}}` (or `"parameters"`), the
piece the llama3_json and mistral parsers share: one object read as it arrives.

  object     at the object's `{`: held until it reads `{"name": "<name>", "arguments": {`;
             then the call starts (index, id, name).
  arguments  the arguments object passed through as it arrives, up to its closing brace
             (strings, escapes and nesting tracked); cut off by the end, the call keeps
             what it has (OpenAI's arguments may be invalid JSON).
  tail       the rest of the object after the arguments, to its closing brace: ignored.
  whole      a header of another shape (keys in another order, "type" first): the object is
             held to its closing brace and parsed whole; a name and object arguments make a
             call, anything else is not a call (the parser decides what it becomes).
A subclass owns what comes around the objects: `_object_done` after a call, `_not_call` for
an object (or a truncated one) that is no call (by default: content to the end), and `_end` for its own states at the end.
"""

from __future__ import annotations

import json

import regex

from shoal.runtime.entrypoints.tool_parsers.base import ToolParser, call_of, coalesce

HEADER = regex.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{', regex.DOTALL)


class JsonScanner:
    """Where a JSON value that opened before `pos` closes, across chunks. With `stop` (a closing
    tag the model may write before its braces close), the scan also halts outside a string
    where `stop`, or what may still become it, begins: `stop_at` says where."""

    def __init__(self, depth: int = 0, stop: str = ""):
        self.depth, self.in_str, self.esc = depth, False, False
        self.stop, self.stop_at = stop, -1

    def scan(self, text: str, pos: int) -> int:
        """The index just past the bracket that brings the depth back to 0, or -1."""
        self.stop_at = -1
        for i in range(pos, len(text)):
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.stop and ch == self.stop[0] and (text.startswith(self.stop, i) or self.stop.startswith(text[i:])):
                self.stop_at = i
                return -1
        return -1


class JsonCallParser(ToolParser):
    def __init__(self, tokenizer=None, max_calls: int | None = None):
        super().__init__(tokenizer, max_calls)
        self.state = "start"
        self.pending = ""
        self.scanner = JsonScanner()
        self.in_object = True  # the arguments sit inside a call object (a tail follows them)
        self.pos = 0  # whole: how far the object has been scanned

    def feed(self, text: str) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while getattr(self, f"_{self.state}")(out):
            pass
        return coalesce(out)

    def finish(self) -> list[dict]:
        out: list[dict] = []
        if self.state in ("object", "whole"):
            self._not_call(out)
        elif self.state == "rest":
            self._rest(out)
        elif self.state not in ("arguments", "tail"):
            self._end(out)
        self.pending, self.state = "", "done"
        return coalesce(out)

    def _done(self, out) -> bool:
        self.pending = ""
        return False

    def _rest(self, out) -> bool:
        """Everything from here on is content."""
        if self.pending:
            out.append({"content": self.pending})
        self.pending = ""
        return False

    # -- one object ----------------------------------------------------------------------------
    def _object(self, out) -> bool:
        m = HEADER.match(self.pending, partial=True)
        if m is not None and m.partial:
            return False  # may still become a header
        name = json.loads(m.group(1)) if m is not None else ""
        self.scanner = JsonScanner()
        if not name:
            self.pos, self.state = 0, "whole"
            return True
        self.start_call(name, out)
        self.in_object = True
        self.pending = self.pending[m.end() - 1:]  # from the arguments' opening brace
        self.state = "arguments"
        return True

    def _arguments(self, out) -> bool:
        end = self.scanner.scan(self.pending, 0)
        cut = len(self.pending) if end < 0 else end
        self.fragment(self.pending[:cut], out)
        self.pending = self.pending[cut:]
        if end < 0:
            return False
        if self.in_object:
            self.scanner, self.state = JsonScanner(depth=1), "tail"
        else:
            self._object_done(out)
        return True

    def _tail(self, out) -> bool:
        end = self.scanner.scan(self.pending, 0)
        if end < 0:
            self.pending = ""
            return False
        self.pending = self.pending[end:]
        self._object_done(out)
        return True

    def _whole(self, out) -> bool:
        end = self.scanner.scan(self.pending, self.pos)
        if end < 0:
            self.pos = len(self.pending)  # scanned: the next chunk goes on from here
            return False
        try:
            call = call_of(json.loads(self.pending[:end]))
        except ValueError:
            call = None
        if call is None:
            self._not_call(out)
            return True
        self.pending = self.pending[end:]
        self.start_call(call[0], out)
        self.fragment(json.dumps(call[1], ensure_ascii=False), out)
        self._object_done(out)
        return True

    # -- the subclass's --------------------------------------------------------------------------
    def _object_done(self, out) -> None:
        raise NotImplementedError

    def _not_call(self, out) -> None:
        """The object at the start of `pending` is not a call (or the end came first): it is
        content, and so is everything after it."""
        self.state = "rest"
        self._rest(out)

    def _end(self, out) -> None:
        pass
