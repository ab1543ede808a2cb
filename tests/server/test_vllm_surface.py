"""vLLM's utility endpoints and metric names, over real HTTP against `shoal serve`.

References: the model's own tokenizer (transformers) for /tokenize and /detokenize, and
prometheus_client's parser with the names the Gateway API inference extension's
model-server protocol reads (its endpoint picker scrapes vllm:* from every pod)."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def hf_tokenizer(builtin_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_dir)


def test_tokenize_a_prompt_matches_the_models_tokenizer(http, model_name, hf_tokenizer):
    text = "The sea is calm — 海は静か 🐟"
    r = http.post("/tokenize", json={"model": model_name, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tokenizer(text).input_ids
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    assert body["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    no_special = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert no_special["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids


def test_tokenize_messages_renders_the_chat_template(http, hf_tokenizer):
    messages = [{"role": "user", "content": "Name a fish."}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids
    # the count is what a chat completion of the same messages is billed as its prompt
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_detokenize_round_trips(http, hf_tokenizer):
    ids = hf_tokenizer("Hello, world: 日本語").input_ids
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf_tokenizer.decode(ids)}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, None),
    ("/detokenize", {"tokens": [10**12]}, None),
    ("/detokenize", {"tokens": [49152 * 4]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, None),
])
def test_bad_utility_requests_are_400_in_openais_shape(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param
    assert http.get("/health").status_code == 200


def test_unknown_model_is_404(http):
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_version_and_load(http):
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version
    assert http.get("/load").json() == {"server_load": 0}


def test_metrics_carry_vllms_names_for_the_inference_extension(server, http, model_name):
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)}
    # the model-server protocol's names and types (gateway-api-inference-extension), plus vLLM's latency histograms
    want = {"vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge", "vllm:kv_cache_usage_perc": "gauge",
            "vllm:lora_requests_info": "gauge", "vllm:time_to_first_token_seconds": "histogram",
            "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram"}
    for name, kind in want.items():
        assert name in families and families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == model_name, (name, sample)
    lora = families["vllm:lora_requests_info"].samples[0].labels
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= lora.keys()
    # same series, same values and buckets as the shoal_* ones
    ttft = {s.labels.get("le"): s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft == {s.labels.get("le"): s.value for s in families["shoal_time_to_first_token_seconds"].samples}
    assert ttft["+Inf"] >= 1
