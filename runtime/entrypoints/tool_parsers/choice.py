"""The request side of tool calling: `tools`, `tool_choice`, `parallel_tool_calls` and the
messages' tool turns checked (400 in OpenAI's shape), and a forced choice turned into a
JSON schema for structured outputs (vLLM's schemas).

    tool_choice      tools in the prompt   output
    "none"           no                    plain content, never parsed
    "auto"           yes                   parsed by --tool-call-parser (needs --enable-auto-tool-choice)
    "required"       yes                   forced: a JSON array of {"name", "parameters"}, at least one
    {"type": "function", "function": {"name"}}
                     yes                   forced: that function's arguments object
Left out, tool_choice is "auto" when tools are given and "none" otherwise (OpenAI, vLLM).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from shoal.runtime.entrypoints.errors import APIError
from shoal.runtime.entrypoints.tool_parsers.registry import get_tool_parser
from shoal.runtime.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128  # OpenAI's bound
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class ToolChoice:
    mode: str  # none | auto | required | named
    tools: list[dict]  # as given (what the template gets)
    function: str | None = None  # the named function
    parallel: bool = True
    parser: type | None = None  # auto: the parser class

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools if self.mode != "none" and self.tools else None

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def schema(self) -> dict | None:
        """The JSON schema a forced choice's output must match (None: not forced)."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            return copy.deepcopy(functions[self.function].get("parameters") or EMPTY_PARAMETERS)
        if self.mode != "required":
            return None
        defs: dict = {}
        items = []
        for name, fn in functions.items():
            params = copy.deepcopy(fn.get("parameters") or EMPTY_PARAMETERS)
            for key, value in (params.pop("$defs", None) or {}).items():  # refs point at the root: hoist them there
                if key in defs and defs[key] != value:
                    raise _bad(f"tools define $defs {key!r} twice, differently; tool_choice 'required' needs them to agree", "tools")
                defs[key] = value
            items.append({"type": "object", "properties": {"name": {"type": "string", "const": name}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def force(self, params) -> None:
        """Set the sampling params' structured outputs for a forced choice; keep special tokens
        in the text for a parser whose markers are special tokens (mistral's [TOOL_CALLS])."""
        if self.mode == "auto" and getattr(self.parser, "keeps_special_tokens", False):
            params.skip_special_tokens = False
        schema = self.schema()
        if schema is None:
            return
        if params.structured_outputs is not None:
            raise _bad("tool_choice 'required' or a named function cannot be combined with other structured outputs", "tool_choice")
        # compact JSON: whitespace carries nothing in a call, and a weak model can loop on it
        params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def check_tools(tools: list[dict]) -> None:
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}].type {tool.get('type')!r} is not supported; only 'function' tools are", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"tools[{i}].function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in seen:
            raise _bad(f"tools[{i}]: the function name {name!r} is used twice", "tools")
        seen.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")


def check_messages(messages) -> None:
    """An assistant turn's tool_calls: each a function call with a name and arguments."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            fn = call.get("function")
            where = f"messages[{i}].tool_calls[{j}]"
            if m.role != "assistant":
                raise _bad(f"{where}: only assistant messages carry tool_calls", "messages")
            if call.get("type", "function") != "function" or not isinstance(fn, dict):
                raise _bad(f"{where} must be a function call", "messages")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _bad(f"{where}.function.name must be a non-empty string", "messages")
            if not isinstance(fn.get("arguments", ""), (str, dict)):
                raise _bad(f"{where}.function.arguments must be a string", "messages")


def tool_choice_of(req, parser_name: str | None, auto_enabled: bool) -> ToolChoice | None:
    """The request's tool choice, checked; None when it uses no tools at all."""
    check_messages(req.messages)
    tools, choice = req.tools, req.tool_choice
    if tools is None and choice is None:
        return None
    tools = tools or []
    check_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolChoice("none", tools, parallel=parallel)
    if not tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return ToolChoice("required", tools, parallel=parallel)
    if choice == "auto":
        if not (auto_enabled and parser_name):
            raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice")
        return ToolChoice("auto", tools, parallel=parallel, parser=get_tool_parser(parser_name))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        return ToolChoice("named", tools, function=name, parallel=parallel)
    raise _bad("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
