"""A request's checks before it joins the engine, shared by LLMEngine and the engine-core
process's client (core_client.py), which must refuse a request at once as the engine would."""

from __future__ import annotations

from shoal.runtime.sampling_params import SamplingParams


def tokenize(tokenizer, vocab_size: int, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids); ValueError for an empty prompt or an id outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, tokenizer(prompt).input_ids
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    return None, ids


def check_request(tokenizer, vocab_size: int, max_model_len: int, scores_prompts: bool, prompt: str | list[int],
                  params: SamplingParams) -> tuple[str | None, list[int]]:
    """The prompt's (text, ids) once the request is known to fit; ValueError naming why not."""
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    params.validate()
    text, ids = tokenize(tokenizer, vocab_size, prompt)
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the model's context is {max_model_len} (max_model_len), "
            "which leaves no room to generate"
        )
    params.check_vocab(vocab_size)
    if params.prompt_logprobs is not None and not scores_prompts:
        raise ValueError("prompt_logprobs is not supported with tensor or pipeline parallelism")
    return text, ids
