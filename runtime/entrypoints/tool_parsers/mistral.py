"""Mistral tool calls (vLLM's `mistral`): text, then `[TOOL_CALLS]` and the calls, in either
of Mistral's two shapes, told apart by the text (vLLM asks the tokenizer's version):

  before v11  `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, {...}]`   a JSON array
  v11 and on  `[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g{...}`                a name, then its arguments

  text       content; text that could be the start of `[TOOL_CALLS]` is held back, and so is
             whitespace before it (whitespace around calls is dropped, as hermes does).
  after_tag  `[` opens the array (its objects read by json_calls.py, `,` between, `]` closes
             it), `{` a lone call object, anything else a v11 name.
  name       up to the arguments' `{` (`[ARGS]` and whitespace dropped); the arguments stream
             through to their closing brace; then text again, where the next `[TOOL_CALLS]`
             starts the next call.
`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's tokenizers, so requests this parser
serves keep special tokens in the text (skip_special_tokens off, as vLLM does). Call ids are
9 letters and digits: Mistral's templates refuse any other in the tool turns sent back.
"""

from __future__ import annotations

import random
import string

from shoal.runtime.entrypoints.streamed_parsers import held_suffix
from shoal.runtime.entrypoints.tool_parsers.json_calls import JsonCallParser, JsonScanner
from shoal.runtime.entrypoints.tool_parsers.registry import register_tool_parser

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


@register_tool_parser("mistral")
class MistralToolParser(JsonCallParser):
    keeps_special_tokens = True

    def __init__(self, tokenizer=None, max_calls: int | None = None):
        super().__init__(tokenizer, max_calls)
        self.state = "text"
        self.after_call = False  # drop whitespace right after a call
        self.in_array = False
        self.lead = ""  # the text since the tag, before its first call: given back if no call comes

    def call_id(self) -> str:
        return mistral_call_id()

    def _text(self, out) -> bool:
        if self.after_call:
            self.pending = self.pending.lstrip()
            if not self.pending:
                return False
            self.after_call = False
        i = self.pending.find(TOOL_CALLS)
        if i >= 0:
            kept = self.pending[:i].rstrip()
            if kept:
                out.append({"content": kept})
            self.lead = self.pending[len(kept):i + len(TOOL_CALLS)]
            self.pending, self.state = self.pending[i + len(TOOL_CALLS):], "after_tag"
            return True
        cut = len(self.pending) - held_suffix(self.pending, TOOL_CALLS)
        cut = len(self.pending[:cut].rstrip())
        if cut:
            out.append({"content": self.pending[:cut]})
            self.pending = self.pending[cut:]
        return False

    def _skip_space(self) -> str:
        """Whitespace before the next piece: into the lead (if any), out of pending."""
        s = self.pending.lstrip()
        if s:
            if self.lead:
                self.lead += self.pending[:len(self.pending) - len(s)]
            self.pending = s
        return s

    def _after_tag(self, out) -> bool:
        s = self._skip_space()
        if not s:
            return False
        if s[0] == "[" and not s.startswith(ARGS) and not ARGS.startswith(s):
            self.lead += "["
            self.pending, self.in_array, self.state = s[1:], True, "item"
        elif s[0] == "[" and ARGS.startswith(s):
            return False  # may be [ARGS] (a v11 call with no name): wait
        elif s[0] == "{":
            self.pending, self.state = s, "object"
        else:
            self.pending, self.state = s, "name"
        return True

    def _item(self, out) -> bool:
        s = self._skip_space()
        if not s:
            return False
        self.pending = s
        if s[0] == "{":
            self.state = "object"
        elif s[0] == "]":
            self._close_array()
        else:
            self._not_call(out)
            return False
        return True

    def _separator(self, out) -> bool:
        s = self.pending.lstrip()
        if not s:
            return False
        if s[0] == ",":
            self.pending, self.state = s[1:], "item"
        elif s[0] == "]":
            self.pending = s
            self._close_array()
        else:
            self.pending, self.in_array, self.state, self.after_call = s, False, "text", True
        return True

    def _close_array(self) -> None:
        self.pending = self.pending[1:]
        self.in_array, self.state, self.after_call = False, "text", True

    def _name(self, out) -> bool:
        i = self.pending.find("{")
        if i < 0:
            return False
        name = self.pending[:i].replace(ARGS, "").strip()
        if not name:
            self.pending, self.state = self.pending[i:], "object"
            return True
        self.start_call(name, out)
        self.pending, self.in_object, self.state = self.pending[i:], False, "arguments"
        self.scanner = JsonScanner()
        return True

    def start_call(self, name: str, out) -> None:
        self.lead = ""
        super().start_call(name, out)

    def _not_call(self, out) -> None:
        self.pending, self.lead = self.lead + self.pending, ""
        super()._not_call(out)

    def _object_done(self, out) -> None:
        if self.in_array:
            self.state = "separator"
        else:
            self.state, self.after_call = "text", True

    def _end(self, out) -> None:
        if self.state == "text" and not self.after_call:
            self._rest(out)
        elif self.lead:  # a tag whose call never came (cut off, or nothing after it): content
            self._not_call(out)
