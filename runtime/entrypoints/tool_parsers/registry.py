"""Tool-call parsers by name (vLLM's --tool-call-parser names): the plugin seam.

A parser registers itself with `@register_tool_parser("name")`; `--tool-parser-plugin FILE`
imports a file that does, before the server checks --tool-call-parser against the names.
"""

from __future__ import annotations

from shoal.runtime.entrypoints.streamed_parsers import ParserRegistry

TOOL_PARSERS = ParserRegistry("tool-call parser")
register_tool_parser = TOOL_PARSERS.register
get_tool_parser = TOOL_PARSERS.get
tool_parser_names = TOOL_PARSERS.names


def load_tool_parser_plugin(path: str) -> None:
    """Import a Python file whose import registers parsers (vLLM's --tool-parser-plugin)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"shoal_tool_parser_plugin_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import a tool parser plugin from {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
