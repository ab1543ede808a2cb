"""Qwen3: as DeepSeek-R1, plus its switch. `chat_template_kwargs: {"enable_thinking": false}`
makes Qwen3's template render an empty `<think>\n\n</think>\n\n` at the end of the prompt, so
the model answers at once: the output is all content (vLLM's Qwen3 parser with thinking
disabled). A template that ignores the switch still gets the whole output as content."""

from __future__ import annotations

from shoal.runtime.entrypoints.reasoning_parsers.base import ReasoningParser, register_reasoning_parser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    @classmethod
    def starts_thinking(cls, prompt_tail: str, template_kwargs: dict | None) -> bool:
        if (template_kwargs or {}).get("enable_thinking", True) is False:  # as the template tests it
            return False
        return super().starts_thinking(prompt_tail, template_kwargs)
