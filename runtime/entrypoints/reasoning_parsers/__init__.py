"""Reasoning parsers (`--reasoning-parser`, docs/reasoning.md): a model's thinking split out of
its answer into `reasoning_content`, whole and streamed."""

from shoal.runtime.entrypoints.reasoning_parsers import deepseek_r1, qwen3  # noqa: F401 - register their names
from shoal.runtime.entrypoints.reasoning_parsers.base import ReasoningParser, get_reasoning_parser, reasoning_parser_names

__all__ = ["ReasoningParser", "get_reasoning_parser", "reasoning_parser_names"]
