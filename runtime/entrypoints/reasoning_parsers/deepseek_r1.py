"""DeepSeek-R1 (and its distills): `<think>` is in the prompt (newer templates) or written by
the model; everything up to `</think>` is thinking. The shared machine is base.py's."""

from __future__ import annotations

from shoal.runtime.entrypoints.reasoning_parsers.base import ReasoningParser, register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    pass
