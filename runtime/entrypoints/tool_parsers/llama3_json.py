"""Llama 3.1/3.2/3.3 JSON tool calls (vLLM's `llama3_json`): the answer is the call,
`{"name": ..., "parameters": {...}}` (or "arguments"), maybe after `<|python_tag|>`, several
separated by `;`. The model's own template (or vLLM's tool_chat_template_llama3.1_json.jinja
with --chat-template) asks for exactly this.

  start    leading whitespace and `<|python_tag|>` held until the first other character:
           `{` opens a call object (json_calls.py), anything else makes the whole answer
           content (as vLLM's streaming parser: a call must open the answer).
  between  after a call: whitespace and one `;`, then `{` opens the next; other text is
           content (vLLM drops it; kept here, nothing is lost).
An object that is not a call is content from there on, with what preceded it (a JSON answer
stays as it was written).
"""

from __future__ import annotations

from shoal.runtime.entrypoints.tool_parsers.json_calls import JsonCallParser
from shoal.runtime.entrypoints.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(JsonCallParser):
    def __init__(self, tokenizer=None, max_calls: int | None = None):
        super().__init__(tokenizer, max_calls)
        self.lead = ""  # what came before the first object: given back if it is no call
        self.tagged = False
        self.semicolon = False

    def _start(self, out) -> bool:
        s = self.pending.lstrip()
        if not s:
            return False
        if not self.tagged and s.startswith(PYTHON_TAG):
            self.lead += self.pending[:len(self.pending) - len(s)] + PYTHON_TAG
            self.pending, self.tagged = s[len(PYTHON_TAG):], True
            return True
        if not self.tagged and PYTHON_TAG.startswith(s):
            return False  # may be the tag
        if s[0] == "{":
            self.lead += self.pending[:len(self.pending) - len(s)]
            self.pending, self.state = s, "object"
            return True
        self._not_call(out)
        return False

    def _between(self, out) -> bool:
        s = self.pending.lstrip()
        if not s:
            self.pending = ""
            return False
        if s[0] == ";" and not self.semicolon:
            self.pending, self.semicolon = s[1:], True
            return True
        self.pending, self.semicolon = s, False
        self.state = "object" if s[0] == "{" else "rest"
        return True

    def _object_done(self, out) -> None:
        self.lead = ""
        self.state = "between"

    def _not_call(self, out) -> None:
        self.pending, self.lead = self.lead + self.pending, ""
        super()._not_call(out)

    def _end(self, out) -> None:
        if self.state == "start":  # only whitespace, or the start of the tag
            self.pending, self.lead = self.lead + self.pending, ""
            self._rest(out)
