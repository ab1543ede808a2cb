"""Tool calling on /v1/chat/completions (docs/tools.md): parsers by name, the chat template
choice, tool_choice checks and forcing, and the generated text turned into tool_calls."""

from shoal.runtime.entrypoints.tool_parsers import hermes, llama3_json, mistral  # noqa: F401 - register their names
from shoal.runtime.entrypoints.tool_parsers.base import ExtractedToolCalls, ToolParser
from shoal.runtime.entrypoints.tool_parsers.registry import get_tool_parser, load_tool_parser_plugin, register_tool_parser, tool_parser_names

__all__ = ["ExtractedToolCalls", "ToolParser", "get_tool_parser", "load_tool_parser_plugin", "register_tool_parser", "tool_parser_names"]
