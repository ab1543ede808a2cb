"""The offline API, like vllm.LLM: `LLM(model=...).generate(prompts, params)` and `.chat`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

from tqdm import tqdm

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.engine import LLMEngine
from shoal.runtime.engine.request import RequestOutput
from shoal.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        if model is not None:
            engine_options["model"] = model
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora: str | None | list[str | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) and return outputs in prompt order.
        `lora`: a loaded adapter's name for every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        # only the final output of each request is read: the engine builds no others
        per_prompt = [dataclasses.replace(p, output_kind="final_only") if isinstance(p, SamplingParams) else p
                      for p in per_prompt]
        adapters = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} LoRA names")
        ids = []
        try:
            for prompt, p, adapter in zip(prompts, per_prompt, adapters):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p, lora=adapter)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 8)

    def _run(self, ids: list[str], show: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generate", disable=not show, unit="req") as bar:
            while wanted - done.keys():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, **template_kwargs):
        """One conversation (a list of {"role", "content"}) or a list of them. `tools` (OpenAI's
        function tools) go to the chat template; a model whose template ignores tools gets the
        shipped Hermes template, as the server does (docs/tools.md). The calls are not parsed.
        Template variables come as keyword arguments or, vLLM's way, as `chat_template_kwargs`
        (`{"enable_thinking": False}`, docs/reasoning.md)."""
        from shoal.runtime.entrypoints.tool_parsers.chat_template import has_tool_turns, named_template, template_messages, tool_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for c in conversations:
            kw = dict(chat_template_kwargs or {}, **template_kwargs)
            if tools or has_tool_turns(c):
                c = template_messages(c)
                kw.update(tools=tools or None, chat_template=kw.get("chat_template") or tool_template(self.tokenizer, named_template(self.tokenizer.chat_template, True)))
            # the template already holds the special tokens: tokenize without adding them again
            text = self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **kw)
            prompts.append(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self.generate(prompts, params, use_tqdm)
