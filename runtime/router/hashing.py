"""A request body -> the block hashes of its prompt, as the servers will compute them.

The prompt is tokenized with the model's tokenizer the way `shoal serve` does it (a chat
rendered with the chat template, then tokenized without special tokens; a completion
prompt with them), on the same kind of tokenizer pool (entrypoints/prompts.py), and hashed
with the engine's own function (cache/block_pool.py). Only the blocks the engine can reuse
count: all full blocks but the one holding the last token. A body the router cannot read
gets no hashes (it is routed by load, and the server answers its 400): token ids that are
not integers in the server's range [0, 2^31) are not hashed at all.
"""

from __future__ import annotations

import logging

from shoal.runtime.cache.block_pool import block_hashes
from shoal.runtime.entrypoints.prompts import PromptTokenizer

logger = logging.getLogger("shoal.router")

MAX_TOKEN_ID = 2**31 - 1  # protocol.TokenId's bound: the server refuses anything past it with a 400
NO_LIMIT = 1 << 40  # the servers enforce the context length; the router only reads
# A prompt this short tokenizes on the event loop: ~30 us, against ~180 us for the hop to a
# pool thread and back (measured; it is most of a short request's time in the router).
INLINE_CHARS = 2048


def _messages(raw) -> list[dict]:
    """OpenAI chat messages as the server hands them to the template (protocol.ChatMessage.text)."""
    out = []
    for m in raw:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        msg = {"role": m["role"], "content": content or ""}
        if m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


class PromptHasher:
    def __init__(self, tokenizer=None, chat_template: str | None = None):
        self.prompts = PromptTokenizer(tokenizer, NO_LIMIT, chat_template=chat_template) if tokenizer is not None else None

    def close(self) -> None:
        if self.prompts is not None:
            self.prompts.close()

    async def token_ids(self, path: str, body) -> list[int]:
        if not isinstance(body, dict):
            return []
        if path.endswith("/chat/completions"):
            if self.prompts is None or not isinstance(body.get("messages"), list):
                return []
            agp = body.get("add_generation_prompt", True)
            messages = _messages(body["messages"])
            if sum(len(m["content"]) for m in messages) <= INLINE_CHARS:
                return self.prompts.chat_ids(messages, bool(agp))
            return await self.prompts.run(self.prompts.chat_ids, messages, bool(agp))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, list):
            return prompt if all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt) else []
        if isinstance(prompt, str) and self.prompts is not None:
            if len(prompt) <= INLINE_CHARS:
                return self.prompts.text_ids(prompt, True)
            return await self.prompts.run(self.prompts.text_ids, prompt, True)
        return []

    async def hashes(self, path: str, body, block_size: int) -> list[int]:
        try:
            ids = await self.token_ids(path, body)
            usable = max(0, (len(ids) - 1) // block_size)
            if usable > 32 and self.prompts is not None:  # ~2 us a block: a long prompt's hashes off the event loop
                return await self.prompts.run(block_hashes, ids[: usable * block_size], block_size)
            return block_hashes(ids[: usable * block_size], block_size)
        except Exception as e:  # noqa: BLE001 - bad messages, a template error: the server will say
            logger.debug("no prefix for this request: %s: %s", type(e).__name__, e)
            return []
