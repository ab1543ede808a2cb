"""Which chat template renders a conversation with tools, and the messages it is given.

The model's own template is used when it renders tools (a probe: render one made-up tool
and look for its name in the text). Many templates ignore `tools` (the built-in SmolLM2's
does, and it cannot render an assistant turn that holds only tool calls), so for those the
shipped Hermes template (hermes_tool_chat_template.jinja, ChatML) renders every request
that offers tools or carries tool turns; conversations without either keep the model's
template untouched. A model that is not ChatML and ignores tools wants --chat-template
with a tool template of its own (docs/tools.md).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

_PROBE_NAME = "shoal_probe_tool_name_7e1f"
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}}]


@functools.cache
def hermes_template() -> str:
    return resources.files(__package__).joinpath("hermes_tool_chat_template.jinja").read_text(encoding="utf-8")


_RENDERS_TOOLS: dict[str, bool] = {}  # template text -> answer (a template's behaviour is its text)


def renders_tools(tokenizer, template: str) -> bool:
    """Does `template` put the tools it is given into the prompt?"""
    known = _RENDERS_TOOLS.get(template)
    if known is None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=_PROBE_TOOLS, chat_template=template,
                                                 tokenize=False, add_generation_prompt=True)
            known = _PROBE_NAME in text
        except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
            known = False
        _RENDERS_TOOLS[template] = known
    return known


def named_template(template, tools: bool):
    """A tokenizer config may hold named templates (transformers turns its list into
    {"default": ..., "tool_use": ...}; Hermes 2 Pro, Command R, some Mistral configs): the tool
    one for a conversation with tools when there is one, else the default, as transformers
    and vLLM choose. A single template is itself."""
    if not isinstance(template, dict):
        return template
    if tools and "tool_use" in template:
        return template["tool_use"]
    return template.get("default")


def tool_template(tokenizer, template: str | None) -> str:
    """The template for a conversation with tools or tool turns: the model's (or the one
    given with --chat-template) if it renders tools, else the shipped Hermes template."""
    if template and renders_tools(tokenizer, template):
        return template
    return hermes_template()


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def request_messages(messages) -> list[dict]:
    """The request's ChatMessages as the dicts a chat template renders."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return template_messages(out)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant turn's tool_calls with the
    arguments as a mapping where they are a JSON object (as vLLM hands them; templates apply
    `tojson`), else left as the string."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_call_for_template(c) for c in calls])
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return dict(call, function=fn)
