"""A hypothesis fuzz driven by the server's own /openapi.json: every numeric field of the
request bodies documents its range (pydantic Field ge/le), and the fuzz probes each edge
from both sides: inside is served (or refused for a documented reason that depends on the
rest of the request, such as the context length), outside is a 400 naming the field, and
the engine lives after each."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = [{"role": "user", "content": "Hi"}]
BIG = 2**53  # beyond this the schema's float bound is not exact: the real bound is int64's
INT64_MAX = 2**63 - 1
# fields with no upper bound in the schema, and why
UNBOUNDED_ABOVE = {"top_k": "values at or above the vocabulary size mean off"}
# an in-range value may still be refused for a reason that depends on the rest of the body
ALLOWED_400 = {"max_tokens": ("context length", "max_tokens 0 needs echo"), "max_completion_tokens": "context length",
               "min_tokens": "min_tokens", "priority": "--scheduling-policy priority", "best_of": "best_of",
               "stop_token_ids": "vocabulary", "prompt": "vocabulary", "allowed_token_ids": "vocabulary",
               "truncate_prompt_tokens": ("-1 (max_model_len) or at least 1", "larger than max_model_len")}


@pytest.fixture(scope="module")
def schema(server):
    return httpx.get(server.base_url + "/openapi.json", timeout=30).json()


def numeric_fields(schema: dict, name: str) -> dict[str, tuple[dict, bool]]:
    """{field: (its numeric JSON-schema alternative, whether the field is an array of it)}"""
    out = {}
    for field, prop in schema["components"]["schemas"][name]["properties"].items():
        for alt in prop.get("anyOf", [prop]):
            if alt.get("type") in ("integer", "number"):
                out[field] = (alt, False)
            elif alt.get("type") == "array" and alt.get("items", {}).get("type") in ("integer", "number"):
                out[field] = (alt["items"], True)
    return out


def edges(alt: dict) -> tuple[list, list, st.SearchStrategy]:
    """(values inside the documented range, values outside it, a strategy for inside)."""
    integer = alt["type"] == "integer"
    step = 1 if integer else 1e-3
    inside, outside = [], []

    def exact(b):
        if integer and abs(b) >= BIG:
            return INT64_MAX if b > 0 else -INT64_MAX - 1
        return int(b) if integer else b

    lo = hi = None
    if "minimum" in alt:
        lo = exact(alt["minimum"])
        inside.append(lo)
        outside.append(lo - step)
    if "exclusiveMinimum" in alt:
        lo = exact(alt["exclusiveMinimum"]) + step
        inside.append(lo)
        outside.append(lo - step)
    if "maximum" in alt:
        hi = exact(alt["maximum"])
        inside.append(hi)
        outside.append(hi + step)
    if lo is not None:
        outside.append(-(10**30) if integer else -1e300)
    if hi is not None:
        outside.append(10**30 if integer else 1e300)
    lo_s = lo if lo is not None else -(2**63)
    hi_s = hi if hi is not None else 2**63
    within = st.integers(lo_s, hi_s) if integer else st.floats(lo_s, hi_s, allow_nan=False)
    return inside, outside, within


def _case(schema, endpoint: str):
    fields = numeric_fields(schema, "CompletionRequest" if endpoint == "completions" else "ChatCompletionRequest")

    @st.composite
    def case(draw):
        field = draw(st.sampled_from(sorted(fields)))
        alt, is_array = fields[field]
        inside, outside, within = edges(alt)
        ok = draw(st.booleans())
        value = draw(st.one_of(st.sampled_from(inside), within) if ok else st.sampled_from(outside))
        return field, [value] if is_array else value, ok

    return case()


def _run(h: httpx.Client, endpoint: str, field: str, value, ok: bool) -> None:
    body = {"prompt": "Hi"} if endpoint == "completions" else {"messages": CHAT, "logprobs": field == "top_logprobs"}
    body.update(max_tokens=2, temperature=0.5)
    if field == "n":
        body["max_tokens"] = 1
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    if field in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and value < 4000 and ok:
        value = min(value, 3)  # keep what is served cheap; the edge itself (1) and the far side are kept
    body[field] = value
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = h.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if ok:
        if r.status_code != 200:
            reasons = ALLOWED_400.get(field, ())
            reasons = (reasons,) if isinstance(reasons, str) else reasons
            assert r.status_code == 400 and any(why in r.json()["error"]["message"] for why in reasons), (field, value, r.text)
    else:
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, (field, value, r.text)
    assert h.get("/health").status_code == 200


def test_every_numeric_field_documents_its_range(schema):
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = numeric_fields(schema, name)
        assert {"n", "temperature", "top_p", "top_k", "seed", "priority", "max_tokens", "logprobs" if name == "CompletionRequest" else "top_logprobs"} <= set(fields)
        for field, (alt, _) in fields.items():
            assert "minimum" in alt or "exclusiveMinimum" in alt, (name, field)
            assert "maximum" in alt or field in UNBOUNDED_ABOVE, (name, field)


@pytest.fixture(scope="module")
def h(server):
    with server.http() as c:
        yield c


FUZZ = settings(max_examples=70, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_schema_edges(schema, h, endpoint):
    @FUZZ
    @given(case=_case(schema, endpoint))
    def run(case):
        _run(h, endpoint, *case)

    run()
