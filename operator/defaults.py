"""Structural defaulting, as the API server does it, from the CRD's own schema.

The API server fills `default`s of absent properties, then descends into objects and
arrays (also into freshly defaulted ones). Doing the same here means the controller
and `shoal operator render` work on what the API server would have stored, and one
schema (operator/crd.py) decides both.
"""

from __future__ import annotations

import copy
from typing import Any

from shoal.operator import crd

DEFAULT_IMAGE = "ghcr.io/shoal-dev/shoal:0.1.0"
DEFAULT_GPU_IMAGE = "ghcr.io/shoal-dev/shoal:0.1.0-cuda"
ACCELERATOR_SUFFIXES = ("/gpu",)  # nvidia.com/gpu, amd.com/gpu, gpu.intel.com/... are matched by suffix
ACCELERATOR_PREFIXES = ("nvidia.com/mig-",)  # MIG slices (nvidia.com/mig-3g.40gb): one per rank too


def _walk(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties")
        if props:
            for key, sub in props.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    value[key] = _walk(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(value):
                if not props or key not in props:
                    value[key] = _walk(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [_walk(item, schema["items"]) for item in value]
    return value


def apply_defaults(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a defaulted deep copy of a whole InferenceDeployment (or of a spec with a spec schema)."""
    schema = schema if schema is not None else crd.openapi_schema()
    return _walk(copy.deepcopy(obj), schema)


def default_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(spec, crd.spec_schema())


def accelerator_keys(spec: dict[str, Any]) -> list[str]:
    res = spec.get("resources") or {}
    keys = set((res.get("limits") or {})) | set((res.get("requests") or {}))
    return sorted(k for k in keys if is_accelerator(k))


def is_accelerator(key: str) -> bool:
    return key.endswith(ACCELERATOR_SUFFIXES) or key.startswith(ACCELERATOR_PREFIXES)


def image_for(spec: dict[str, Any]) -> str:
    """The runtime image: spec.image, else the CUDA or the CPU build by the accelerators asked for."""
    if spec.get("image"):
        return spec["image"]
    return DEFAULT_GPU_IMAGE if accelerator_keys(spec) else DEFAULT_IMAGE
