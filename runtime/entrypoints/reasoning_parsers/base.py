"""What a reasoning parser is: one choice's generated text in, reasoning and content deltas out.

The thinking models write `<think>` (or find it at the end of their prompt), think, write
`</think>`, then answer. A parser is fed the text as it arrives (`feed`) and told when it ends
(`finish`); each call returns deltas, in order:
    {"reasoning_content": "..."}    thinking
    {"content": "..."}              the answer
One machine serves both modes, so a stream, however it is cut, adds up to `extract`:
  reasoning  the start: text is thinking. The first `<think>` is dropped (the model may write
             it or the template may have put it in the prompt); `</think>` ends the thinking.
             A tail that could be the start of either tag is held back until it is decided.
             No `</think>` at all (cut off by max_tokens): all of it is thinking.
  content    after `</think>`: everything is the answer, tags included.
A parser built with `thinking=False` starts in content (the prompt closed the think block:
Qwen3's enable_thinking=False, see `starts_thinking`).
"""

from __future__ import annotations

from shoal.runtime.entrypoints.streamed_parsers import ParserRegistry, held_suffix

START, END = "<think>", "</think>"

REASONING_PARSERS = ParserRegistry("reasoning parser")
register_reasoning_parser = REASONING_PARSERS.register
get_reasoning_parser = REASONING_PARSERS.get
reasoning_parser_names = REASONING_PARSERS.names


class ReasoningParser:
    """`<think>...</think>` then the answer (DeepSeek-R1's and Qwen3's shape); one per choice."""

    name = ""

    def __init__(self, thinking: bool = True):
        self.state = "reasoning" if thinking else "content"
        self.opened = False  # the opening tag was seen (and dropped)
        self.pending = ""

    @classmethod
    def starts_thinking(cls, prompt_tail: str, template_kwargs: dict | None) -> bool:
        """Does the output start inside the think block? Not when the prompt ends by closing
        one (a template that renders an empty `<think></think>` to switch thinking off), as
        vLLM's prompt_is_reasoning_end, scoped here to the end of the prompt."""
        return not prompt_tail.rstrip().endswith(END)

    def feed(self, text: str) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while self.state == "reasoning":
            text = self.pending
            end = text.find(END)
            start = -1 if self.opened else text.find(START)
            if start >= 0 and (end < 0 or start < end):
                _add(out, "reasoning_content", text[:start])
                self.pending, self.opened = text[start + len(START):], True
                continue
            if end >= 0:
                _add(out, "reasoning_content", text[:end])
                self.pending, self.state = text[end + len(END):], "content"
                break
            hold = max(held_suffix(text, END), 0 if self.opened else held_suffix(text, START))
            _add(out, "reasoning_content", text[:len(text) - hold])
            self.pending = text[len(text) - hold:]
            return out
        _add(out, "content", self.pending)
        self.pending = ""
        return out

    def finish(self) -> list[dict]:
        """The end: a held-back tail was not a tag after all."""
        out: list[dict] = []
        _add(out, "reasoning_content" if self.state == "reasoning" else "content", self.pending)
        self.pending = ""
        return out

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole response, None for an empty part; the parser is used up."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        return reasoning or None, content or None


def _add(out: list[dict], key: str, text: str) -> None:
    if text:
        out.append({key: text})
