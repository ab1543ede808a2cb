"""Model resolution, the GGUF -> HF conversion of the built-in model, and the checkpoint readers.

The built-in SmolLM2 conversion goes to the default cache (``$SHOAL_CACHE`` or ``~/.cache/shoal``)
so repeated runs reuse it; the atomicity and concurrency tests use a tiny GGUF written here and a
temporary ``SHOAL_CACHE``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import tiny_llama as _tiny_llama
from gguf_files import write_tiny_gguf as _write_tiny_gguf
from shoal.runtime.models import gguf_convert
from shoal.runtime.models.gguf_convert import convert_gguf
from shoal.runtime.models.loader import (
    SUPPORTED_ARCHITECTURES,
    builtin_gguf_path,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
)

PROMPTS = ["The capital of France is", "def fib(n):\n    return", "In 2024, 17 people ate 365 apples."]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """On a shared, busy CPU, torch's second thread spin-waits: 1 thread is ~6x faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def builtin_dir() -> Path:
    return resolve_model("builtin://smollm2-135m-instruct")


@pytest.fixture(scope="session")
def builtin_model(builtin_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gguf_reference(builtin_dir):
    """transformers reading the GGUF itself: its own config parsing, names, Q/K un-permutation and
    dequantization -- ``(model, config dict)``.

    This is what ``from_pretrained(dir, gguf_file=...)`` does, spelled out: that call insists on
    ``accelerate``, which the runtime does not need, and would parse the GGUF twice.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext

    import gguf as gguf_package

    with torch.device("meta"):  # only its parameter names are used, to map the GGUF's
        namer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(builtin_dir))
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds the same name table for each of ~400 submodules; build it once
        mp.setattr(gguf_package, "get_tensor_name_map", functools.cache(gguf_package.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(builtin_gguf_path()), return_tensors=True, model_to_load=namer)
    del namer
    config = dict(parsed["config"])
    ref_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval(), dict(parsed["config"])


@pytest.fixture(scope="session")
def gguf_reference_model(gguf_reference):
    return gguf_reference[0]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    model = _tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_tiny_gguf(path, model)
    return path, model


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "shoal-cache"
    monkeypatch.setenv("SHOAL_CACHE", str(cache))
    return cache


# ----------------------------------------------------------------------------- the built-in model


def test_builtin_matches_transformers_gguf(builtin_model, gguf_reference_model, builtin_dir):
    tok = load_tokenizer(builtin_dir)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ours = builtin_model(ids).logits
            ref = gguf_reference_model(ids).logits
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert tok.decode(builtin_model(ids).logits[0, -1].argmax()) == " Paris"  # real weights, real text


def test_builtin_config_and_files(builtin_dir, gguf_reference):
    files = {p.name for p in builtin_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    assert not any(n.startswith(".") for n in files)
    cfg = load_config(builtin_dir)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    raw = json.loads((builtin_dir / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and raw["rms_norm_eps"] == 1e-5 and raw["torch_dtype"] == "float32"
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    _, ref = gguf_reference  # what transformers itself reads from the GGUF metadata
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert raw[key] == ref[key], key
    assert raw["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)
    assert raw["rope_theta"] == pytest.approx(ref.get("rope_theta", ref.get("rope_parameters", {}).get("rope_theta")))
    gen = json.loads((builtin_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    # resolving again is a cache hit, and the bare name is accepted
    assert resolve_model("smollm2-135m-instruct") == builtin_dir


def test_builtin_weights_names_and_dtype(builtin_dir, builtin_model):
    expected = {k for k in builtin_model.state_dict() if k != "lm_head.weight"}  # tied
    seen = {}
    for name, tensor in iter_weights(builtin_dir):
        assert tensor.dtype == torch.float32
        seen[name] = tuple(tensor.shape)
    assert set(seen) == expected
    assert seen["model.embed_tokens.weight"] == (49152, 576)
    assert seen["model.layers.0.self_attn.k_proj.weight"] == (192, 576)


def test_quantized_blocks_come_from_the_conversions_table_as_transformers_dequantizes_them(builtin_dir, gguf_reference_model):
    """The serving path maps the GGUF's blocks through the table its conversion recorded (no
    metadata parse): every block, dequantized by gguf's own code, is the weight transformers
    reads from the GGUF itself (Q/K rows un-permuted)."""
    import gguf as gguf_package

    blocks = gguf_convert.quantized_weights(builtin_dir)
    reference = gguf_reference_model.state_dict()
    assert len(blocks) >= 7 * gguf_reference_model.config.num_hidden_layers  # every layer's projections
    for name, (qtype, rows) in blocks.items():
        weight = gguf_package.quants.dequantize(np.ascontiguousarray(rows), gguf_package.GGMLQuantizationType(qtype))
        torch.testing.assert_close(torch.from_numpy(weight), reference[name], atol=0, rtol=0, msg=name)
    assert gguf_convert.quantized_weights(builtin_dir.parent) is None  # not a conversion


def test_builtin_tokenizer(builtin_dir):
    tok = load_tokenizer(builtin_dir)
    assert tok.is_fast
    for text in ["Hello, world! Ça va? 你好 🙂", "  leading spaces\nand\ttabs", "x = [1, 22, 333]"]:
        assert tok.decode(tok(text).input_ids) == text
    assert tok("<|im_start|>user")["input_ids"][0] == 1  # specials stay whole
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert tok("hi").input_ids[0] != tok.bos_token_id  # no BOS added (add_bos_token false)
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]  # smollm pre-tokenizer: single digits
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert "chat_template" in json.loads((builtin_dir / "tokenizer_config.json").read_text())


# ----------------------------------------------------------------------------- conversion on a tiny GGUF


def test_tiny_gguf_roundtrip_is_exact(tiny_gguf, tmp_cache):
    from transformers import AutoModelForCausalLM

    path, reference = tiny_gguf
    out = resolve_model(str(path))
    assert out.parent == tmp_cache / "models" and out.name.startswith("gguf-")
    converted = dict(iter_weights(out))
    expected = reference.state_dict()
    assert set(converted) == set(expected)
    for name, tensor in converted.items():  # F32 tensors come back bit-exact, Q/K un-permuted
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 60, 70, 259, 261, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    tok = load_tokenizer(out)
    assert tok.tokenize(" the") == ["Ġthe"] and tok.decode(tok(" the hello").input_ids) == " the hello"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert resolve_model(f"file://{path}") == out  # same file, same cache entry


def test_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    out = tmp_path / "models" / "tiny"
    real = gguf_convert._write_tokenizer

    def boom(*args, **kwargs):  # weights already written, tokenizer not yet
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(gguf_convert, "_write_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out, progress=False)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []

    # a conversion killed outright leaves its temporary directory behind; the next one clears it
    stale = out.parent / f".{out.name}.tmp-999999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(gguf_convert, "_write_tokenizer", real)
    assert convert_gguf(path, out, progress=False) == out
    assert not stale.exists()
    assert gguf_convert.is_converted(out, path)
    load_config(out)
    assert len(dict(iter_weights(out))) > 0


def test_converted_dir_is_redone_when_stale(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = convert_gguf(path, tmp_path / "tiny", progress=False)
    manifest = out / gguf_convert.MANIFEST
    data = json.loads(manifest.read_text())
    data["converter_version"] = -1
    manifest.write_text(json.dumps(data))
    assert not gguf_convert.is_converted(out, path)
    convert_gguf(path, out, progress=False)
    assert gguf_convert.is_converted(out, path)


CONCURRENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from shoal.runtime.models import gguf_convert
    real = gguf_convert._convert_into
    def slow(*args, **kwargs):
        print("CONVERTING", flush=True)
        time.sleep(1.0)  # widen the window in which the other process must wait
        return real(*args, **kwargs)
    gguf_convert._convert_into = slow
    print("DIR", gguf_convert.convert_gguf(sys.argv[1], sys.argv[2], progress=False), flush=True)
    """
)


def test_concurrent_conversion_converts_once(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "models" / "tiny"
    procs = [
        subprocess.Popen([sys.executable, "-c", CONCURRENT_SCRIPT, str(path), str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
        assert f"DIR {out}" in stdout
    assert sum(stdout.count("CONVERTING") for stdout, _ in results) == 1
    assert gguf_convert.is_converted(out, path)
    assert json.loads((out / gguf_convert.MANIFEST).read_text())["converter_pid"] in {p.pid for p in procs}
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny", "tiny.lock"]
    load_config(out)
    load_tokenizer(out)


# ----------------------------------------------------------------------------- resolve_model


def test_resolve_local_dirs(tmp_path):
    _tiny_llama(vocab_size=64).save_pretrained(tmp_path / "m")
    assert resolve_model(str(tmp_path / "m")) == (tmp_path / "m").resolve()
    assert resolve_model(f"file://{tmp_path / 'm'}") == (tmp_path / "m").resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("source", ["s3://bucket/model", "ftp://x/y", "no-such-model", "builtin://no-such-model", ""])
def test_resolve_rejects_bad_sources(source):
    with pytest.raises(ValueError) as err:
        resolve_model(source)
    message = str(err.value)
    assert "builtin://" in message or "smollm2-135m-instruct" in message


def test_resolve_hf_without_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="pre-download|Pre-download"):
        resolve_model("hf://shoal-tests/definitely-not-cached", revision="main")
    with pytest.raises(ValueError, match="hf://ORG/NAME"):
        resolve_model("hf://just-a-name")
    with pytest.raises(ValueError, match="file:///"):
        resolve_model("file://somehost/abs/dir")


# ----------------------------------------------------------------------------- load_config, iter_weights


def test_load_config_rejects_unsupported(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "a")
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "b")  # no architectures
    for d, named in ((tmp_path / "a", "GPT2LMHeadModel"), (tmp_path / "b", "gpt2")):
        with pytest.raises(ValueError) as err:
            load_config(d)
        for arch in SUPPORTED_ARCHITECTURES:
            assert arch in str(err.value)
        assert named in str(err.value)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


def test_iter_weights_sharded_and_bin(tmp_path):
    model = _tiny_llama(vocab_size=300)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    expected = model.state_dict()

    it = iter_weights(tmp_path / "sharded")
    first_name, first = next(it)  # lazy: one tensor at a time
    got = {first_name: first, **dict(it)}
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)
    assert load_config(tmp_path / "sharded").num_key_value_heads == 2

    (tmp_path / "bin").mkdir()
    torch.save({k: v.clone() for k, v in expected.items()}, tmp_path / "bin" / "pytorch_model.bin")
    got = dict(iter_weights(tmp_path / "bin"))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)

    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError):
        next(iter_weights(tmp_path / "none"))
