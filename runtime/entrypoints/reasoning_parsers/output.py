"""The response side of reasoning: one choice's text through the reasoning parser first, its
content then through the tool-call parser (tool_parsers/output.py), as vLLM orders them, so
calls are only looked for in the answer. `ChatOutput` has ToolOutput's interface (`stream`,
`message`), so the renderer treats both alike.

The thinking goes out twice, as `reasoning_content` (DeepSeek's name, vLLM before 0.11, what
most clients read) and as `reasoning` (vLLM's name now); a request with
`include_reasoning: false` gets neither (vLLM's field)."""

from __future__ import annotations

from shoal.runtime.entrypoints.tool_parsers.base import assemble
from shoal.runtime.entrypoints.tool_parsers.output import ChoiceStream, ToolOutput

PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see a closed think block


def prompt_tail(prompts, ids: list[int]):
    """Runs on the tokenizer pool: the end of the prompt as text (starts_thinking reads it)."""
    return prompts.decode(ids[-PROMPT_TAIL_TOKENS:])


class ChatStream:
    """One choice: `feed(text)` and `finish()` give OpenAI deltas; `finish_reason` as the tools'."""

    def __init__(self, parser, tools: ChoiceStream | None, include_reasoning: bool):
        self.parser, self.tools, self.include = parser, tools, include_reasoning

    def _route(self, deltas: list[dict], end: bool = False) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if "reasoning_content" in d:
                if self.include:
                    out.append({"reasoning_content": d["reasoning_content"], "reasoning": d["reasoning_content"]})
            elif self.tools is not None:
                out += self.tools.feed(d["content"])
            else:
                out.append(d)
        if end and self.tools is not None:
            out += self.tools.finish()
        return out

    def feed(self, text: str) -> list[dict]:
        return self._route(self.parser.feed(text))

    def finish(self) -> list[dict]:
        return self._route(self.parser.finish(), end=True)

    def finish_reason(self, reason: str | None) -> str | None:
        return self.tools.finish_reason(reason) if self.tools is not None else reason


class ChatOutput:
    """One request's reasoning (and tools, if any) on the response side."""

    def __init__(self, parser_cls: type, thinking: bool, tools: ToolOutput | None = None, include_reasoning: bool = True):
        self.parser_cls, self.thinking, self.tools, self.include = parser_cls, thinking, tools, include_reasoning
        self.streams: dict[int, ChatStream] = {}

    def _new(self) -> ChatStream:
        tools = ChoiceStream(self.tools.choice, self.tools.tokenizer) if self.tools is not None else None
        return ChatStream(self.parser_cls(thinking=self.thinking), tools, self.include)

    def stream(self, index: int) -> ChatStream:
        s = self.streams.get(index)
        if s is None:
            s = self.streams[index] = self._new()
        return s

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole choice: (the assistant message, its finish_reason)."""
        s = self._new()
        deltas = s.feed(text) + s.finish()
        got = assemble(deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        message = {"role": "assistant", "content": got.content}
        if self.include:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if got.tool_calls:
            message["tool_calls"] = got.tool_calls
        return message, s.finish_reason(finish_reason)


async def chat_output(state, req, ids: list[int], tools: ToolOutput | None):
    """The request's output handler: `tools` as it is without --reasoning-parser, else a
    ChatOutput around it (the prompt's end is read to know whether thinking starts)."""
    if not state.reasoning_parser:
        return tools
    from shoal.runtime.entrypoints.reasoning_parsers import get_reasoning_parser

    parser_cls = get_reasoning_parser(state.reasoning_parser)
    tail = await state.prompts.run(prompt_tail, state.prompts, ids)
    thinking = parser_cls.starts_thinking(tail, req.chat_template_kwargs)
    return ChatOutput(parser_cls, thinking, tools, include_reasoning=req.include_reasoning)
