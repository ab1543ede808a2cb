"""Tool-call parsers by name (vLLM's --tool-call-parser names): the plugin seam.

A parser registers itself with `@register_tool_parser("name")`; `--tool-parser-plugin FILE`
imports a file that does, before the server checks --tool-call-parser against the names.
"""

from __future__ import annotations

_PARSERS: dict[str, type] = {}


def register_tool_parser(name: str):
    def wrap(cls):
        _PARSERS[name] = cls
        cls.name = name
        return cls

    return wrap


def get_tool_parser(name: str) -> type:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"no tool-call parser {name!r}; known: {', '.join(sorted(_PARSERS))}") from None


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def load_tool_parser_plugin(path: str) -> None:
    """Import a Python file whose import registers parsers (vLLM's --tool-parser-plugin)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"shoal_tool_parser_plugin_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import a tool parser plugin from {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
