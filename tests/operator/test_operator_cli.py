"""`shoal operator render | crd | run` wiring, and that importing the CLI stays light."""

from __future__ import annotations

import argparse
import subprocess
import sys

import yaml

from shoal_op_helpers import ROOT


def parse(*argv):
    from shoal.operator import operator_cli as cli

    parser = argparse.ArgumentParser(prog="shoal operator")
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_importing_the_cli_pulls_no_torch_runtime_or_kopf():
    code = ("import sys, argparse; from shoal.operator import operator_cli as cli; cli.add_arguments(argparse.ArgumentParser()); "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('shoal.runtime', 'kopf'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_run_options():
    a = parse("run", "-n", "a", "-n", "b", "--metrics-port", "9090")
    assert a.namespaces == ["a", "b"] and a.metrics_port == 9090 and callable(a.func)
    a = parse("run")
    assert a.metrics_port == 8080 and a.liveness.endswith("/healthz") and a.namespaces == []


def test_render_prints_every_object(capsys, tmp_path):
    path = ROOT / "manifests" / "samples" / "llama-tp2-pp2-gpu.yaml"
    args = parse("render", str(path))
    assert args.func(args) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    kinds = sorted(d["kind"] for d in docs)
    # groups, their policies, PDB and monitors; the router (routing.mode shoal by default): its
    # Deployment, PDB and PodMonitor, the traffic Service over it and the leaders' headless Service
    assert kinds == ["Deployment", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget", "PodDisruptionBudget",
                     "PodMonitor", "PodMonitor", "Service", "Service", "Service", "ServiceMonitor",
                     "StatefulSet", "StatefulSet"]
    sts = [d for d in docs if d["kind"] == "StatefulSet"]
    assert all(s["spec"]["replicas"] == 2 for s in sts)
    assert sts[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    # defaults applied as the CRD would
    args_ = sts[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args_[args_.index("--block-size") + 1] == "16"

    empty = tmp_path / "x.yaml"
    empty.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    args = parse("render", str(empty))
    assert args.func(args) == 1


def test_crd_command_matches_the_file(capsys):
    args = parse("crd")
    assert args.func(args) == 0
    assert capsys.readouterr().out == (ROOT / "crds" / "shoal.dev_inferencedeployments.yaml").read_text()


def test_run_serves_metrics_and_liveness_and_stops_on_sigterm(tmp_path):
    """`shoal operator run` for real, in a subprocess, against KMock (no handlers fire: no objects)."""
    import asyncio
    import os
    import signal
    import socket
    import time
    import urllib.request

    from kmock._internal import apps, k8s

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    mport, lport = free_port(), free_port()

    async def scenario():
        async with k8s.KubernetesEmulator() as km, apps.Server(km):
            for res, kind, namespaced in [("shoal.dev/v1alpha1/inferencedeployments", "InferenceDeployment", True),
                                          ("apps/v1/statefulsets", "StatefulSet", True)]:
                km.resources[res] = km.ResourceInfo(kind=kind, namespaced=namespaced,
                                                    verbs={"list", "watch", "get", "patch"})
            kc = tmp_path / "kubeconfig"
            kc.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "k",
                "clusters": [{"name": "k", "cluster": {"server": str(km.url).rstrip("/")}}],
                "users": [{"name": "k", "user": {"token": "t"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}]}))
            env = dict(os.environ, KUBECONFIG=str(kc), SHOAL_OPERATOR_SCANNING="0")
            code = ("import sys, argparse; from shoal.operator import operator_cli as cli; p = argparse.ArgumentParser(); "
                    "cli.add_arguments(p); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
            proc = subprocess.Popen([sys.executable, "-c", code, "run", "-n", "default", "--metrics-port", str(mport),
                                     "--liveness", f"http://127.0.0.1:{lport}/healthz"],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def probe():
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        m = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read().decode()
                        h = urllib.request.urlopen(f"http://127.0.0.1:{lport}/healthz", timeout=2).status
                        return m, h
                    except OSError:
                        time.sleep(0.3)
                return None, None
            try:
                text, health = await asyncio.to_thread(probe)
            finally:
                proc.send_signal(signal.SIGTERM)
                out, _ = await asyncio.to_thread(proc.communicate, None, 60)
            assert text is not None, out
            assert "shoal_operator_reconcile_total" in text and health == 200
            assert proc.returncode == 0, out

    asyncio.run(scenario())


def test_render_refuses_an_invalid_spec(capsys, tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: shoal.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: llama.v2}\n"
                 "spec: {model: {source: 'builtin://smollm2-135m-instruct'}}\n")
    args = parse("render", str(f))
    assert args.func(args) == 1
    assert "DNS label" in capsys.readouterr().err
