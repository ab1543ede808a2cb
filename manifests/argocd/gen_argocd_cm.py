#!/usr/bin/env python3
"""Writes argocd-cm.yaml (the argocd-cm ConfigMap patch) from inferencedeployment-health.lua.

The .lua file is the one source of truth.

    python manifests/argocd/gen_argocd_cm.py           # rewrite argocd-cm.yaml
    python manifests/argocd/gen_argocd_cm.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "inferencedeployment-health.lua"
TARGET = HERE / "argocd-cm.yaml"
KEY = "resource.customizations.health.shoal.dev_InferenceDeployment"

HEADER = """\
# GENERATED from inferencedeployment-health.lua by gen_argocd_cm.py -- do not edit by hand.
# Argo CD's health check for shoal.dev/InferenceDeployment. Merge it into argocd-cm:
#     kubectl -n argocd patch configmap argocd-cm --type merge --patch-file manifests/argocd/argocd-cm.yaml
# or list it under `patches:` of the kustomization that installs Argo CD (docs/gitops.md).
"""


def render(lua: str) -> str:
    body = "".join(("    " + line if line.strip() else "") + "\n" for line in lua.rstrip("\n").split("\n"))
    return (
        HEADER
        + "apiVersion: v1\n"
        + "kind: ConfigMap\n"
        + "metadata:\n"
        + "  name: argocd-cm\n"
        + "  namespace: argocd\n"
        + "  labels:\n"
        + "    app.kubernetes.io/name: argocd-cm\n"
        + "    app.kubernetes.io/part-of: argocd\n"
        + "data:\n"
        + f"  {KEY}: |\n"
        + body
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if argocd-cm.yaml is not up to date")
    args = parser.parse_args(argv)
    text = render(SOURCE.read_text())
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.name} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
