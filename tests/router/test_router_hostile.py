"""Bad input through `shoal router` (one real group behind it): always the group's 4xx in
OpenAI's shape, or the router's own in the same shape, never a 5xx; the router hashes only
what it can read. Over real HTTP, as tests/server/test_hostile.py does for the server."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router_helpers import backends_state, start_group, start_router, wait_for
from server_helpers import wait_until_ready


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, builtin_dir):
    from engine_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-router-hostile"), builtin_dir)


@pytest.fixture(scope="module")
def routed(model_dir):
    group = start_group(model_dir, wait=False)
    router = start_router([group.base_url], "--tokenizer", str(model_dir))
    try:
        wait_until_ready(group)
        wait_for(lambda: all(b["ready"] for b in backends_state(router).values()), what="the group ready at the router")
        with httpx.Client(base_url=router.base_url, timeout=120) as c:
            yield group, router, c
    finally:
        rc = router.stop()
        group.stop()
    assert rc == 0, router.log()[-3000:]


def assert_4xx(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


def assert_alive(c: httpx.Client) -> None:
    r = c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.mark.parametrize("ids", [[2**32], [2**32 + 5] * 40, [-1] * 40, [2**31] * 40, [2**64], [10**30], [49152 + 7] * 40])
def test_token_ids_out_of_range_are_the_groups_400(routed, ids):
    """Past 2^32 the router's hash used to raise (a 500); past the vocabulary the group says so."""
    group, _, c = routed
    for path, body in (("/v1/completions", {"prompt": ids}), ("/v1/completions", {"prompt": [ids, [1, 2]]})):
        r = c.post(path, json=dict(body, model="m", max_tokens=1))
        direct = httpx.post(group.base_url + path, json=dict(body, model="m", max_tokens=1), timeout=60)
        assert r.status_code == direct.status_code == 400, (r.text, direct.text)
        assert r.json()["error"] == direct.json()["error"]
    assert_alive(c)


def test_json_nested_past_the_stack_is_a_4xx(routed):
    _, _, c = routed
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in ("[" * 100_000 + "]" * 100_000, '{"prompt": ' + "[" * 50_000 + "1" + "]" * 50_000 + "}"):
            assert_4xx(c.post(path, content=body, headers={"content-type": "application/json"}))
    assert_alive(c)


# JSON of any shape, and values that look almost right
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20)
token_ids = st.lists(st.one_of(st.integers(min_value=-(2**40), max_value=2**70), st.booleans(), st.floats(allow_nan=False)),
                     min_size=1, max_size=80)
messages = st.lists(st.one_of(
    json_values,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "nobody", 5])},
                          optional={"content": st.one_of(json_values, st.text(max_size=50),
                                                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_values}), max_size=3)),
                                    "name": json_values, "tool_calls": json_values})),
    max_size=4)
completion_bodies = st.fixed_dictionaries({"prompt": st.one_of(json_values, token_ids, st.lists(token_ids, max_size=3), st.text(max_size=200))},
                                          optional={"max_tokens": json_values, "n": json_values, "stream": st.booleans()})
chat_bodies = st.fixed_dictionaries({"messages": st.one_of(messages, json_values)},
                                    optional={"tools": json_values, "add_generation_prompt": json_values, "max_tokens": json_values,
                                              "stream": st.booleans()})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_hostile_bodies_never_get_a_5xx_from_the_router(routed, data):
    _, _, c = routed
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = data.draw(st.one_of(completion_bodies if path == "/v1/completions" else chat_bodies, json_values))
    if isinstance(body, dict):
        body.setdefault("max_tokens", 1)
    raw = data.draw(st.one_of(st.just(json.dumps(body).encode()), st.binary(max_size=64)))
    r = c.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]} for {raw[:300]!r}"
    if r.status_code != 200:
        assert_4xx(r)


def test_the_group_and_router_still_serve(routed):
    _, router, c = routed
    assert_alive(c)
    assert "Traceback" not in router.log(), router.log()[-3000:]
