"""LoRA over HTTP: a real `shoal serve --enable-lora` with adapters given at start and loaded at
run time, talked to with the openai client; each adapter's tokens equal transformers + PEFT's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import lora_prompts, make_lora_models, make_peft_adapter, peft_greedy
from server_helpers import served

MAX_NEW = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory, builtin_dir):
    root = tmp_path_factory.mktemp("lora-server")
    base, adapters = make_lora_models(root, builtin_dir, count=3)
    return root, base, adapters


@pytest.fixture(scope="module")
def server(models):
    root, base, adapters = models
    a1 = json.dumps({"name": "a1", "path": str(adapters["a1"]), "base_model_name": "tiny"})
    with served([str(base), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                 "--lora-modules", f"a0={adapters['a0']}", a1]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=300)


def complete(client, model, prompt, max_tokens=MAX_NEW):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"min_tokens": max_tokens, "return_token_ids": True})
    return out.choices[0].token_ids


def test_models_lists_adapters_with_their_parent(client, models):
    _, _, adapters = models
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a0", "a1"}
    assert cards["a0"].parent == "tiny" and cards["a0"].root == str(adapters["a0"])
    assert cards["tiny"].parent is None
    assert client.models.retrieve("a1").parent == "tiny"


def test_concurrent_requests_for_base_and_adapters_get_their_own_tokens(client, models):
    _, base, adapters = models
    prompts = lora_prompts()
    rows = [(model, p) for p in range(len(prompts)) for model in ("tiny", "a0", "a1")]
    with ThreadPoolExecutor(len(rows)) as pool:
        got = list(pool.map(lambda row: complete(client, row[0], prompts[row[1]]), rows))
    refs = {name: peft_greedy(base, adapters.get(name), prompts, MAX_NEW) for name in ("tiny", "a0", "a1")}
    assert got == [refs[model][p] for model, p in rows]


def test_kv_blocks_tell_a_router_which_adapters_the_slots_hold(server):
    """The reply a router polls names the adapters in the device slots; its Backend reads them
    (the picker's LoRA affinity)."""
    from shoal.runtime.router.backends import Backend

    reply = httpx.get(server.base_url + "/kv/blocks").json()
    assert reply["lora"]["max_lora"] == 2 and set(reply["lora"]["slots"]) == {"a0", "a1"}
    backend = Backend(server.base_url)
    backend.apply(reply)
    assert backend.view().adapters == {"a0", "a1"}


def test_chat_selects_the_adapter(client, models):
    _, base, adapters = models
    out = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "Hello there"}], max_tokens=MAX_NEW,
                                         temperature=0, extra_body={"min_tokens": MAX_NEW, "return_token_ids": True})
    assert out.model == "a1"
    assert out.choices[0].token_ids == peft_greedy(base, adapters["a1"], [out.prompt_token_ids], MAX_NEW)[0]


def test_load_and_unload_at_run_time(server, client, models, builtin_dir):
    root, base, adapters = models
    with server.http(timeout=300) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert r.status_code == 200 and "a2" in r.text
        prompts = lora_prompts()[:1]
        assert [complete(client, "a2", prompts[0])] == peft_greedy(base, adapters["a2"], prompts, MAX_NEW)

        big = make_peft_adapter(base, root / "rank32", seed=7, r=32, lora_alpha=32, target_modules=["q_proj"])
        embed = make_peft_adapter(base, root / "embed", seed=8, r=4, lora_alpha=8, target_modules=["embed_tokens"])
        refused = {
            "bad path": ({"lora_name": "x", "lora_path": str(root / "missing")}, 404, "no PEFT adapter"),
            "rank": ({"lora_name": "x", "lora_path": str(big)}, 400, "over --max-lora-rank 16"),
            "target": ({"lora_name": "x", "lora_path": str(embed)}, 400, "embed_tokens"),
            "clash": ({"lora_name": "a0", "lora_path": str(adapters["a2"])}, 400, "already loaded"),
            "base name": ({"lora_name": "tiny", "lora_path": str(adapters["a2"])}, 400, "base model"),
        }
        for why, (body, status, words) in refused.items():
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and words in r.json()["error"]["message"], (why, r.text)
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404

        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200
        assert "a2" not in {m.id for m in client.models.list().data}
        import openai

        with pytest.raises(openai.NotFoundError):
            complete(client, "a2", prompts[0])
        assert http.get("/health").status_code == 200


def test_unloading_an_adapter_lets_its_requests_finish(server, client, models):
    """A streaming request of a0 runs while a0 is unloaded: it ends with every token it asked for,
    and vllm:lora_requests_info showed a0 running meanwhile."""
    _, base, adapters = models
    prompt = lora_prompts()[1]
    want = peft_greedy(base, adapters["a0"], [prompt], 60)[0]
    stream = client.completions.create(model="a0", prompt=prompt, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"min_tokens": 60, "return_token_ids": True})
    tokens, running = [], None
    with server.http(timeout=300) as http:
        for chunk in stream:
            tokens += chunk.choices[0].token_ids or [] if chunk.choices else []
            if running is None and tokens:
                families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
                running = families["vllm:lora_requests_info"].samples[0].labels
                assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 200
        text = http.get("/metrics").text
    assert tokens == want
    assert running["running_lora_adapters"] == "a0" and running["max_lora"] == "2"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    served = {s.labels["lora_name"]: s.value for s in families["shoal_lora_requests"].samples if s.name.endswith("_total")}
    assert served["a0"] >= 4 and served["a1"] >= 4
    loads = [s.value for s in families["shoal_lora_slot_loads"].samples if s.name.endswith("_total")]
    assert loads[0] >= 3
    assert "a0" not in {m.id for m in client.models.list().data}
