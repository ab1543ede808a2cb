"""Chat templates as the families' tokenizer configs hold them: a config with named templates
(a list of {"name", "template"}, which transformers loads as a dict) renders its "tool_use"
template for a request with tools and its "default" otherwise, on the server's tokenizer pool
and in LLM.chat, as transformers' own apply_chat_template chooses; chat_template_kwargs reach
the template."""

from __future__ import annotations

import json
import shutil
import types

import pytest

from shoal.runtime.entrypoints.prompts import PromptTokenizer
from shoal.runtime.models.loader import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = [
    {"name": "default", "template": "DEFAULT {% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ greeting | default('') }}"},
    {"name": "tool_use", "template": "TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}"
                                     "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
]


@pytest.fixture(scope="module")
def named_tokenizer(tmp_path_factory, builtin_dir):
    path = tmp_path_factory.mktemp("named-templates")
    shutil.copy(builtin_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((builtin_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = NAMED
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert isinstance(tok.chat_template, dict)
    return tok


def test_the_pool_picks_the_named_template_as_transformers_does(named_tokenizer):
    prompts = PromptTokenizer(named_tokenizer, 512, workers=1)
    try:
        for tools in (None, TOOLS):
            want = named_tokenizer.apply_chat_template(ASK, tools=tools, tokenize=False, add_generation_prompt=True)
            got = named_tokenizer.decode(prompts.chat_ids(ASK, True, False, tools))
            assert got == want
        assert named_tokenizer.decode(prompts.chat_ids(ASK, True, False, TOOLS)).startswith("TOOLS get_weather")
        greeted = named_tokenizer.decode(prompts.chat_ids(ASK, True, False, None, {"greeting": "hello!"}))
        assert greeted.startswith("DEFAULT") and greeted.endswith("hello!")
    finally:
        prompts.close()


def test_llm_chat_picks_the_tool_template(named_tokenizer):
    from shoal.runtime.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)  # no engine: capture the prompts handed to generate
    llm.engine = types.SimpleNamespace(tokenizer=named_tokenizer)
    llm.generate = lambda prompts, params, use_tqdm: prompts
    (with_tools,) = llm.chat(ASK, tools=TOOLS)
    (without,) = llm.chat(ASK)
    assert named_tokenizer.decode(with_tools).startswith("TOOLS get_weather")
    assert named_tokenizer.decode(without).startswith("DEFAULT user: Weather in Paris?")


def test_reserved_names_cover_apply_chat_templates_arguments(named_tokenizer):
    import inspect

    from shoal.runtime.entrypoints.prompts import RESERVED_TEMPLATE_KWARGS, check_template_kwargs

    own = set(inspect.signature(type(named_tokenizer).apply_chat_template).parameters) - {"kwargs"}
    assert own <= RESERVED_TEMPLATE_KWARGS, own - RESERVED_TEMPLATE_KWARGS
    for name in own:
        with pytest.raises(ValueError, match=name):
            check_template_kwargs({name: 1})
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


def test_llm_chat_takes_chat_template_kwargs(named_tokenizer):
    from shoal.runtime.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine = types.SimpleNamespace(tokenizer=named_tokenizer)
    llm.generate = lambda prompts, params, use_tqdm: prompts
    (vllm_way,) = llm.chat(ASK, chat_template_kwargs={"greeting": "hello!"})
    (keyword,) = llm.chat(ASK, greeting="hello!")
    assert vllm_way == keyword and named_tokenizer.decode(vllm_way).endswith("hello!")
