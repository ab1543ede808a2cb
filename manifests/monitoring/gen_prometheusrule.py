#!/usr/bin/env python3
"""Writes prometheusrule.yaml (a prometheus-operator PrometheusRule) from rules.yaml.

rules.yaml is the one source of truth; this wraps its `groups` unchanged.

    python manifests/monitoring/gen_prometheusrule.py           # rewrite prometheusrule.yaml
    python manifests/monitoring/gen_prometheusrule.py --check   # exit 1 if it is stale

Needs only PyYAML.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "rules.yaml"
TARGET = HERE / "prometheusrule.yaml"

HEADER = """\
# GENERATED from rules.yaml by gen_prometheusrule.py -- do not edit by hand.
# Prometheus (via prometheus-operator) loads it when its ruleSelector matches these
# labels; kube-prometheus-stack's default selector wants `release: <helm release name>`,
# which a kustomize patch or `commonLabels` adds (docs/monitoring.md).
"""


class _Dumper(yaml.SafeDumper):
    """Block style, multi-line strings as `|` blocks, so the output diffs well."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(source_text: str) -> str:
    rules = yaml.safe_load(source_text)
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "shoal",
            "labels": {
                "app.kubernetes.io/name": "shoal",
                "app.kubernetes.io/component": "monitoring",
                "app.kubernetes.io/part-of": "shoal",
            },
        },
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if prometheusrule.yaml is not up to date")
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
