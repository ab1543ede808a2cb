"""A request's structured-output and logit fields -> SamplingParams (docs/structured_outputs.md).

    response_format {type: json_object | json_schema {schema}}  (OpenAI)
    structured_outputs {json | regex | choice | grammar | json_object}  (vLLM)
    guided_json | guided_regex | guided_choice | guided_grammar  (vLLM's older spellings)
    logit_bias {"token id": bias}, allowed_token_ids, bad_words

At most one of the grammar fields; each error is a 400 that names its field. The grammar
itself is compiled later, on the tokenizer pool (serving.py), where a schema or regex the
engine cannot compile is a 400 too.
"""

from __future__ import annotations

from shoal.runtime.entrypoints.errors import APIError
from shoal.runtime.sampling_params import StructuredOutputsParams

BACKENDS = ("xgrammar", "auto")


def _spec(req) -> tuple[StructuredOutputsParams, str] | None:
    """The request's grammar, and the field that asked for it."""
    asked = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_object":
            asked.append((dict(json_object=True), "response_format"))
        elif rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            asked.append((dict(json=schema), "response_format"))
        elif rf.type != "text":
            raise APIError(400, f"response_format type must be text, json_object or json_schema, got {rf.type!r}",
                           param="response_format")
    so = req.structured_outputs
    if so is not None:
        kw = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
              if v is not None}
        if so.json_object:
            kw["json_object"] = True
        if so.disable_any_whitespace:
            kw["disable_any_whitespace"] = True
        asked.append((kw, "structured_outputs"))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            asked.append(({key: value}, name))
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend must be one of {', '.join(BACKENDS)} (this server runs xgrammar), "
                            f"got {req.guided_decoding_backend!r}", param="guided_decoding_backend")
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"give at most one of response_format, structured_outputs and guided_*; got {', '.join(f for _, f in asked)}",
                       param=asked[1][1])
    kw, field = asked[0]
    if isinstance(kw.get("json"), bool):
        raise APIError(400, "a JSON schema must be an object", param=field)
    try:
        return StructuredOutputsParams(**kw), field
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def _logit_bias(req) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        bias[token] = value
    return bias


def grammar_field(req) -> str | None:
    """The body field that asked for a grammar (the param of a compile error)."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return next((f for f in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(req, f) is not None), None)


def fields(req) -> dict:
    """The SamplingParams fields the body's grammar and logit fields ask for (a 400 naming
    the field for a bad grammar field; the values are checked when the params are built)."""
    found = _spec(req)
    return {"structured_outputs": found[0] if found is not None else None, "logit_bias": _logit_bias(req),
            "allowed_token_ids": list(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
            "bad_words": list(req.bad_words) if req.bad_words is not None else None}


def param_of(error: Exception) -> str | None:
    """The body field a SamplingParams error is about, where its message names one."""
    return next((f for f in ("logit_bias", "allowed_token_ids", "bad_words", "stop_token_ids") if str(error).startswith(f)), None)
