"""Spec -> desired Kubernetes objects. Pure: no I/O, no clock, no randomness.

One InferenceDeployment `NAME` owns:

- per group: a StatefulSet `NAME-REV-IDX` of `pipeline` pods (Parallel pod management,
  update strategy OnDelete: a group's pods never change in place, a change is a new
  revision and new groups); pod `-0` is the leader;
- `NAME-headless`: a headless Service over all pods, publishing not-ready addresses so
  that workers find their leader (`SHOAL_LEADER_ADDR`) before the group is ready;
- what stands in front of the groups, by `spec.routing.mode` (routing_objects):
  `shoal` (default): a router Deployment `NAME-router`, the traffic Service `NAME` over
  the router pods, a headless Service `NAME-leaders` over the ready leaders (what the
  router resolves), a PodDisruptionBudget `NAME-router`; `service`: the traffic Service
  `NAME` over the ready leaders (pod index 0), port 8000; `inferencePool`: an
  InferencePool `NAME` over the leaders and the headless `NAME-leaders`;
- `NAME`: a PodDisruptionBudget (one pod, so one group, at a time);
- per group: a NetworkPolicy `NAME-REV-IDX`: only the group's pods reach its pods but
  for the HTTP port, and with Volcano gang scheduling a PodGroup `NAME-REV-IDX` (both
  created before the group's StatefulSet and deleted with it);
- with `monitoring.serviceMonitor`: a ServiceMonitor `NAME` (leaders, via the traffic
  Service) and a PodMonitor `NAME-pods` (every group pod), else scrape annotations.

Every object carries `shoal.dev/*` and `app.kubernetes.io/*` labels and, when the
owner has a uid, a controller ownerReference to it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import posixpath
from typing import Any

from shoal.operator import autoscale, crd, defaults

HTTP_PORT = 8000
DIST_PORT = 29500
MODEL_MOUNT = "/models"
SHM_GI_PER_TENSOR_RANK = 2
STARTUP_SECONDS = 1800         # ceiling for loading a model; the probe passes as soon as /health does
PRESTOP_SLEEP_SECONDS = 5      # lets endpoint removal reach the proxies before SIGTERM
GRACE_MARGIN_SECONDS = 15
RUN_AS_USER = 1000
# readOnlyRootFilesystem: what the runtime writes goes to emptyDirs (torch/Triton caches,
# HF_HOME under HOME=/home/shoal in the images, temporary files).
WRITABLE_DIRS = (("tmp", "/tmp"), ("home", "/home/shoal"))
WRITABLE_DIR_SIZE = "4Gi"

L_DEPLOYMENT = "shoal.dev/deployment"
L_GROUP = "shoal.dev/group"
L_REVISION = "shoal.dev/revision"
L_ROLE = "shoal.dev/role"
L_INDEX = "shoal.dev/group-index"
L_POD_INDEX = "apps.kubernetes.io/pod-index"
L_ROUTER = "shoal.dev/router"      # router pods carry this, not shoal.dev/deployment (see router_labels)
L_SERVICE = "shoal.dev/service"
A_SPEC_HASH = "shoal.dev/spec-hash"
A_MODEL_REVISION = "shoal.dev/model-revision"
L_KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
A_KUEUE_COUNT = "kueue.x-k8s.io/pod-group-total-count"
A_VOLCANO_GROUP = "scheduling.k8s.io/group-name"
RESERVED_ENV_PREFIX = "SHOAL_"


# ---------------------------------------------------------------- names and labels

def revision_name_part(revision: str) -> str:
    return revision[:8]


def group_name(name: str, revision: str, index: int) -> str:
    return f"{name}-{revision_name_part(revision)}-{index}"


def _group_labels(name: str, revision: str, index: int) -> tuple[str, dict[str, str]]:
    """A group's name and the labels its objects carry."""
    group = group_name(name, revision, index)
    return group, {L_GROUP: group, L_REVISION: revision, L_INDEX: str(index)}


def headless_name(name: str) -> str:
    return f"{name}-headless"


def leader_addr(name: str, namespace: str, group: str, cluster_domain: str = "cluster.local") -> str:
    return f"{group}-0.{headless_name(name)}.{namespace}.svc.{cluster_domain}"


def serving_url(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """Where clients reach the model: the traffic Service (OpenAI-compatible API under /v1)."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{HTTP_PORT}"


def routing_mode(spec: dict[str, Any]) -> str:
    return (spec.get("routing") or {}).get("mode", "shoal")


def router_name(name: str) -> str:
    return f"{name}-router"


def leaders_name(name: str) -> str:
    return f"{name}-leaders"


def common_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "shoal", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "inference", "app.kubernetes.io/part-of": "shoal",
            "app.kubernetes.io/managed-by": "shoal-operator", L_DEPLOYMENT: name}


def selector_labels(name: str) -> dict[str, str]:
    return {L_DEPLOYMENT: name}


def leader_selector_labels(name: str) -> dict[str, str]:
    return {L_DEPLOYMENT: name, L_POD_INDEX: "0"}


def selector(name: str) -> str:
    """The scale subresource's selector: one leader pod per group."""
    return ",".join(f"{k}={v}" for k, v in leader_selector_labels(name).items())


def _meta(body: dict[str, Any], name: str, labels: dict[str, str] | None = None,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    owner = body["metadata"]["name"]
    meta: dict[str, Any] = {"name": name, "namespace": body["metadata"].get("namespace") or "default",
                            "labels": {**common_labels(owner), **(labels or {})}}
    if annotations:
        meta["annotations"] = dict(annotations)
    ref = owner_reference(body)
    if ref:
        meta["ownerReferences"] = [ref]
    return meta


def owner_reference(body: dict[str, Any]) -> dict[str, Any] | None:
    uid = body["metadata"].get("uid")
    if not uid:
        return None
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": body["metadata"]["name"], "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def canonical_hash(obj: Any, length: int = 16) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()[:length]


# ---------------------------------------------------------------- model sources

def model_cache_name(name: str) -> str:
    return f"{name}-model-cache"


def model_cache_key(spec: dict[str, Any]) -> str:
    """What the shared cache must hold: one download per (source, revision)."""
    return canonical_hash([spec["model"]["source"], spec["model"].get("revision", "main")], length=8)


def uses_model_cache(spec: dict[str, Any]) -> bool:
    return spec["model"]["source"].startswith("hf://") and bool((spec["model"].get("cache") or {}).get("enabled"))


def _fetch_env(model: dict[str, Any], repo: str, target: str) -> list[dict[str, Any]]:
    env = [{"name": "HF_HOME", "value": posixpath.join(MODEL_MOUNT, ".hf")},
           {"name": "SHOAL_MODEL_REPO", "value": repo},
           {"name": "SHOAL_MODEL_REVISION", "value": model.get("revision", "main")},
           {"name": "SHOAL_MODEL_DIR", "value": target}]
    secret = model.get("tokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    return env


def _fetch_script(more: str = "") -> str:
    return ("import os\nfrom huggingface_hub import snapshot_download\n"
            "snapshot_download(repo_id=os.environ['SHOAL_MODEL_REPO'], revision=os.environ['SHOAL_MODEL_REVISION'],"
            f" local_dir=os.environ['SHOAL_MODEL_DIR']{more})\n")


FETCH_SCRIPT = _fetch_script()


def model_plan(spec: dict[str, Any], name: str = "") -> dict[str, Any]:
    """How the pod gets the model: the MODEL argument, volumes, mounts, init containers."""
    model = spec["model"]
    source: str = model["source"]
    plan: dict[str, Any] = {"arg": source, "volumes": [], "mounts": [], "init": []}
    if source.startswith("file://"):
        plan["arg"] = source[len("file://"):]
    elif source.startswith("pvc://"):
        claim, _, path = source[len("pvc://"):].partition("/")
        plan["arg"] = posixpath.join(MODEL_MOUNT, path) if path else MODEL_MOUNT
        plan["volumes"].append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        plan["mounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif source.startswith("hf://") and uses_model_cache(spec):
        # The shared cache: filled once by the fetch Job (one directory per revision), read-only here.
        repo = source[len("hf://"):]
        plan["arg"] = posixpath.join(MODEL_MOUNT, repo, model_cache_key(spec))
        plan["volumes"].append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": model_cache_name(name), "readOnly": True}})
        plan["mounts"].append({"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif source.startswith("hf://"):
        repo = source[len("hf://"):]
        target = posixpath.join(MODEL_MOUNT, repo)
        plan["arg"] = target
        cache: dict[str, Any] = {}
        if model.get("cacheSize") is not None:
            cache["sizeLimit"] = model["cacheSize"]
        plan["volumes"].append({"name": "model-cache", "emptyDir": cache})
        plan["mounts"].append({"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": True})
        plan["init"].append({
            "name": "fetch-model",
            "command": ["python3", "-c", FETCH_SCRIPT],
            "env": _fetch_env(model, repo, target),
            "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_MOUNT}],
        })
    return plan


# ---------------------------------------------------------------- LoRA adapters (spec.model.adapters)

ADAPTER_MOUNT = "/adapters"
ADAPTER_DOWNLOADS = "adapter-downloads"        # hf:// adapters without the shared cache, fetched at pod start
ADAPTER_DOWNLOAD_DIR = posixpath.join(ADAPTER_MOUNT, "hf")
FETCH_ADAPTERS_SCRIPT = (
    "import os, posixpath\nfrom huggingface_hub import snapshot_download\n"
    "for repo in os.environ['SHOAL_ADAPTER_REPOS'].split():\n"
    "    snapshot_download(repo_id=repo, local_dir=posixpath.join(os.environ['SHOAL_ADAPTER_DIR'], repo))\n")


def lora_enabled(spec: dict[str, Any]) -> bool:
    """`model.adapters` present, even empty: the groups run with --enable-lora (part of the
    revision), so adapters can come and go on them later without a rollout."""
    return spec["model"].get("adapters") is not None


def adapter_cache_key(source: str) -> str:
    """An hf:// adapter's directory in the shared cache (one download per source)."""
    return canonical_hash([source, "main"], length=8)


def adapter_plan(spec: dict[str, Any], adapter: dict[str, Any]) -> dict[str, Any]:
    """Where one adapter's files are in a group's pods (`path`) and what the pods need for it:
    `volume` (a volume that holds it), `claim` (a claim to mount for it), `fetch` (an hf://
    repo downloaded at pod start), `cacheKey` (its directory in the shared cache, filled by a Job)."""
    src = adapter["source"]
    plan: dict[str, Any] = {"name": adapter["name"], "source": src, "path": "", "volume": None,
                            "claim": None, "fetch": None, "cacheKey": None}
    if src.startswith("file://"):
        plan["path"] = src[len("file://"):]
    elif src.startswith("pvc://"):
        claim, _, path = src[len("pvc://"):].partition("/")
        model = spec["model"]["source"]
        if model.startswith("pvc://") and model[len("pvc://"):].partition("/")[0] == claim:
            plan.update(path=posixpath.join(MODEL_MOUNT, path), volume="model")   # the model's claim, mounted already
        else:
            plan.update(path=posixpath.join(ADAPTER_MOUNT, "pvc", claim, path), claim=claim,
                        volume=f"adapter-{canonical_hash(claim, length=8)}")
    elif uses_model_cache(spec):
        repo, key = src[len("hf://"):], adapter_cache_key(src)
        plan.update(path=posixpath.join(MODEL_MOUNT, repo, key), volume="model-cache", cacheKey=key)
    else:
        repo = src[len("hf://"):]
        plan.update(path=posixpath.join(ADAPTER_DOWNLOAD_DIR, repo), volume=ADAPTER_DOWNLOADS, fetch=repo)
    return plan


def adapter_plans(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [adapter_plan(spec, a) for a in spec["model"].get("adapters") or []]


def adapter_on_pod(plan: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether a running pod can load the adapter: it runs with --enable-lora and has the
    adapter's files (in the image, on a volume it mounts, or among the repos its init
    container downloaded). A pod's volumes are fixed at its start, so
    an adapter on a claim it lacks (or an hf:// one without the shared cache) waits for the
    group's next start (the StatefulSet's template has it)."""
    spec = pod.get("spec") or {}
    if "--enable-lora" not in ((spec.get("containers") or [{}])[0].get("args") or []):
        return False   # a group of the revision before `adapters` was added: the rollout replaces it
    if plan["fetch"]:
        for ic in spec.get("initContainers") or []:
            for e in ic.get("env") or []:
                if e.get("name") == "SHOAL_ADAPTER_REPOS" and plan["fetch"] in str(e.get("value", "")).split():
                    return True
        return False
    if plan["volume"]:
        return any(v.get("name") == plan["volume"] for v in spec.get("volumes") or [])
    return True


def _adapter_pod_parts(spec: dict[str, Any]) -> dict[str, Any]:
    """What the adapters add to a group's pods: volumes, mounts, an init container."""
    plans = adapter_plans(spec)
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for plan in plans:
        if plan["claim"] and not any(v["name"] == plan["volume"] for v in volumes):
            volumes.append({"name": plan["volume"], "persistentVolumeClaim": {"claimName": plan["claim"], "readOnly": True}})
            mounts.append({"name": plan["volume"], "mountPath": posixpath.join(ADAPTER_MOUNT, "pvc", plan["claim"]),
                           "readOnly": True})
    repos = [p["fetch"] for p in plans if p["fetch"]]
    init: list[dict[str, Any]] = []
    if repos:
        volumes.append({"name": ADAPTER_DOWNLOADS, "emptyDir": {}})
        mounts.append({"name": ADAPTER_DOWNLOADS, "mountPath": ADAPTER_DOWNLOAD_DIR, "readOnly": True})
        env = [{"name": "HF_HOME", "value": posixpath.join(ADAPTER_DOWNLOAD_DIR, ".hf")},
               {"name": "SHOAL_ADAPTER_REPOS", "value": " ".join(repos)},
               {"name": "SHOAL_ADAPTER_DIR", "value": ADAPTER_DOWNLOAD_DIR}]
        secret = spec["model"].get("tokenSecret")
        if secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": secret["name"], "key": secret.get("key", "token")}}})
        init.append({"name": "fetch-adapters", "command": ["python3", "-c", FETCH_ADAPTERS_SCRIPT], "env": env,
                     "volumeMounts": [{"name": ADAPTER_DOWNLOADS, "mountPath": ADAPTER_DOWNLOAD_DIR}]})
    return {"volumes": volumes, "mounts": mounts, "init": init}


def lora_args(spec: dict[str, Any]) -> list[str]:
    """--enable-lora and the adapters a pod starts with: all but those in the shared cache,
    whose Job may still be downloading (the operator loads them once it is done)."""
    if not lora_enabled(spec):
        return []
    plans = [p for p in adapter_plans(spec) if not p["cacheKey"]]
    return ["--enable-lora"] + (["--lora-modules"] + [f"{p['name']}={p['path']}" for p in plans] if plans else [])


def without_adapter_list(body: dict[str, Any]) -> dict[str, Any]:
    """The body with `model.adapters` emptied (kept present: --enable-lora stays): what the
    revision is hashed from, so that changing the list rolls no group."""
    if not body["spec"]["model"].get("adapters"):
        return body
    out = copy.deepcopy(body)
    out["spec"]["model"]["adapters"] = []
    return out


# ---------------------------------------------------------------- pods

def serve_args(body: dict[str, Any], model_arg: str) -> list[str]:
    spec = body["spec"]
    eng, par = spec["engine"], spec["parallelism"]
    served = spec["model"].get("servedName") or body["metadata"]["name"]
    args = [
        "serve", model_arg,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--served-model-name", served,
        "--tensor-parallel-size", str(par["tensor"]),
        "--pipeline-parallel-size", str(par["pipeline"]),
        "--max-num-seqs", str(eng["maxNumSeqs"]),
        "--max-num-batched-tokens", str(eng["maxNumBatchedTokens"]),
        "--max-model-len", str(eng["maxModelLen"]),
        "--block-size", str(eng["blockSize"]),
        "--enable-prefix-caching" if eng["enablePrefixCaching"] else "--no-enable-prefix-caching",
        "--scheduling-policy", eng["schedulingPolicy"],
        "--drain-timeout", str(eng["drainTimeoutSeconds"]),
    ]
    return args + lora_args(spec) + list(eng.get("extraArgs") or [])


def container_resources(spec: dict[str, Any]) -> dict[str, Any]:
    res = spec.get("resources") or {}
    tensor = spec["parallelism"]["tensor"]
    out: dict[str, Any] = {part: dict(res[part]) for part in ("requests", "limits") if res.get(part)}
    accelerators = defaults.accelerator_keys(spec)
    for key in accelerators:
        # Accelerators are per pod = tensor ranks; extended resources need limits (requests follow).
        out.setdefault("limits", {})[key] = tensor
        if key in out.get("requests", {}):
            out["requests"][key] = tensor
    # A CPU pod: a cpu or memory request without a limit gets one equal to it, so both given make a
    # Guaranteed pod (whole CPUs: exclusive cores under the kubelet's static CPU manager policy).
    for key in () if accelerators else ("cpu", "memory"):
        if key in out.get("requests", {}):
            out.setdefault("limits", {}).setdefault(key, out["requests"][key])
    return out


def init_resources(main: dict[str, Any]) -> dict[str, Any]:
    """The main container's cpu and memory where it limits both (a pod's QoS class counts its init
    containers; it reserves the larger of theirs and the main one's, so no more), else none."""
    if not {"cpu", "memory"} <= set(main.get("limits") or {}):
        return {}
    return {part: {k: v for k, v in main[part].items() if k in ("cpu", "memory")} for part in main}


def scrape_annotations(spec: dict[str, Any]) -> dict[str, str]:
    if spec["monitoring"]["serviceMonitor"]:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}


def _probes(startup_period: int, startup_seconds: int, startup_timeout: int) -> dict[str, Any]:
    """Startup and liveness on /health, readiness on /ready, and the preStop pause."""
    def probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                "failureThreshold": failures, "timeoutSeconds": timeout}
    return {"startupProbe": probe("/health", startup_period, startup_seconds // startup_period, startup_timeout),
            "livenessProbe": probe("/health", 10, 3, 5), "readinessProbe": probe("/ready", 5, 2, 3),
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "readOnlyRootFilesystem": True}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def pod_template(body: dict[str, Any], group: str | None, cluster_domain: str = "cluster.local") -> dict[str, Any]:
    """The pod template of one group. With group=None: the revision's template (what is hashed)."""
    spec = body["spec"]
    name = body["metadata"]["name"]
    namespace = body["metadata"].get("namespace") or "default"
    par = spec["parallelism"]
    user = spec.get("podTemplate") or {}
    model = model_plan(spec, name)
    adapters = _adapter_pod_parts(spec)

    env: list[dict[str, Any]] = [
        {"name": "SHOAL_PIPELINE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{L_POD_INDEX}']"}}},
        {"name": "SHOAL_PIPELINE_SIZE", "value": str(par["pipeline"])},
        {"name": "SHOAL_TENSOR_SIZE", "value": str(par["tensor"])},
        {"name": "SHOAL_DIST_PORT", "value": str(DIST_PORT)},
        # worker pods keep serving this long after SIGTERM, until the leader has drained the group
        {"name": "SHOAL_DRAIN_TIMEOUT", "value": str(spec["engine"]["drainTimeoutSeconds"])},
        {"name": "SHOAL_MODEL_REVISION", "value": spec["model"].get("revision", "main")},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if group is not None:
        env[:0] = [
            {"name": "SHOAL_GROUP", "value": group},
            {"name": "SHOAL_LEADER_ADDR", "value": leader_addr(name, namespace, group, cluster_domain)},
        ]
    env += [e for e in (user.get("env") or []) if not str(e.get("name", "")).startswith(RESERVED_ENV_PREFIX)]

    drain = spec["engine"]["drainTimeoutSeconds"]
    container: dict[str, Any] = {
        "name": "shoal",
        "image": defaults.image_for(spec),
        "command": ["shoal"],
        "args": serve_args(body, model["arg"]),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": container_resources(spec),
        **_probes(startup_period=10, startup_seconds=STARTUP_SECONDS, startup_timeout=5),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]
                        + [{"name": v, "mountPath": path} for v, path in WRITABLE_DIRS]
                        + model["mounts"] + adapters["mounts"] + list(user.get("volumeMounts") or []),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if user.get("envFrom"):
        container["envFrom"] = list(user["envFrom"])
    if user.get("imagePullPolicy"):
        container["imagePullPolicy"] = user["imagePullPolicy"]

    init: list[dict[str, Any]] = []
    for ic in model["init"] + adapters["init"]:
        mounts = list(ic.get("volumeMounts") or []) + [{"name": v, "mountPath": p} for v, p in WRITABLE_DIRS]
        init.append({**ic, "volumeMounts": mounts, "image": container["image"],
                     "securityContext": container["securityContext"],
                     "resources": init_resources(container["resources"])})
    if par["pipeline"] > 1:
        # Workers join the leader: wait until the leader's rendezvous port answers (rank 0 skips).
        wait = (
            "import os, socket, sys, time\n"
            "if os.environ['SHOAL_PIPELINE_RANK'] == '0': sys.exit(0)\n"
            "addr, port = os.environ['SHOAL_LEADER_ADDR'], int(os.environ['SHOAL_DIST_PORT'])\n"
            "while True:\n"
            "    try:\n"
            "        socket.create_connection((addr, port), timeout=2).close(); break\n"
            "    except OSError:\n"
            "        print('waiting for leader', addr, port, flush=True); time.sleep(2)\n"
        )
        init.append({
            "name": "wait-for-leader",
            "image": container["image"],
            "command": ["python3", "-c", wait],
            "env": [e for e in env if e["name"] in ("SHOAL_PIPELINE_RANK", "SHOAL_LEADER_ADDR", "SHOAL_DIST_PORT")],
            "securityContext": container["securityContext"],
            "resources": init_resources(container["resources"]),
        })

    shm_limit = f"{max(1, par['tensor']) * SHM_GI_PER_TENSOR_RANK}Gi"
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_limit}}]
                   + [{"name": v, "emptyDir": {"sizeLimit": WRITABLE_DIR_SIZE}} for v, _ in WRITABLE_DIRS]
                   + model["volumes"] + adapters["volumes"] + list(user.get("volumes") or []),
        # The runtime talks to no Kubernetes API: no token in its pods.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS + drain + GRACE_MARGIN_SECONDS,
        "securityContext": _pod_security(),
        "enableServiceLinks": False,
    }
    if init:
        pod_spec["initContainers"] = init
    # serviceAccountName only reaches here where the operator allows it (validate.problems).
    for key in ("nodeSelector", "affinity", "priorityClassName", "runtimeClassName", "schedulerName",
                "serviceAccountName", "imagePullSecrets", "tolerations", "topologySpreadConstraints"):
        if user.get(key):
            pod_spec[key] = copy.deepcopy(user[key])
    # The group's own value where it is known; the revision's template (group=None, what is
    # hashed) carries a placeholder, so that a placement change is a new revision too.
    group_value = group if group is not None else "GROUP"
    place = spec["placement"]
    affinity = placement_affinity(place, group_value)
    if affinity:
        ours = pod_spec.setdefault("affinity", {}).setdefault("podAffinity", {})
        for kind, terms in affinity.items():
            ours[kind] = list(ours.get(kind) or []) + terms
    if place["spreadGroups"]:
        pod_spec["topologySpreadConstraints"] = list(pod_spec.get("topologySpreadConstraints") or []) + [{
            # pods of the same pipeline rank apart: so the groups are
            "maxSkew": 1, "topologyKey": place["spreadTopologyKey"], "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {L_DEPLOYMENT: name}}, "matchLabelKeys": [L_POD_INDEX],
        }]
    if place.get("schedulerName"):
        pod_spec["schedulerName"] = place["schedulerName"]

    user_meta = user.get("metadata") or {}
    labels = {**(user_meta.get("labels") or {}), **common_labels(name)}
    annotations = {**(user_meta.get("annotations") or {}), **scrape_annotations(spec),
                   A_MODEL_REVISION: spec["model"].get("revision", "main")}
    if place["gangScheduling"] == "Kueue":
        # Kueue's plain pod groups: admitted (and scheduled) all `pipeline` pods or none.
        labels[L_KUEUE_GROUP] = group_value
        annotations[A_KUEUE_COUNT] = str(par["pipeline"])
    elif place["gangScheduling"] == "Volcano":
        # Volcano gang-schedules the pods of the group's PodGroup (volcano_pod_group).
        annotations[A_VOLCANO_GROUP] = group_value
        pod_spec["schedulerName"] = place.get("schedulerName") or "volcano"
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def placement_affinity(place: dict[str, Any], group: str) -> dict[str, list[dict[str, Any]]]:
    """Pod affinity that keeps a group's pods within one `groupTopologyKey` domain."""
    term = {"labelSelector": {"matchLabels": {L_GROUP: group}}, "topologyKey": place["groupTopologyKey"]}
    if place["colocateGroup"] == "Required":
        return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    if place["colocateGroup"] == "Preferred":
        return {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}
    return {}


def revision_hash(body: dict[str, Any]) -> str:
    """Hash of everything that reaches a pod (the group-independent pod template), but the
    adapter list: adapters are loaded and unloaded on running groups instead."""
    return canonical_hash(pod_template(without_adapter_list(body), group=None), length=8)


# ---------------------------------------------------------------- objects

def _stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Record the hash of the desired object, so re-applying an unchanged one is skipped."""
    obj["metadata"].setdefault("annotations", {})[A_SPEC_HASH] = canonical_hash(obj)
    return obj


def group_statefulset(body: dict[str, Any], revision: str, index: int,
                      cluster_domain: str = "cluster.local") -> dict[str, Any]:
    name = body["metadata"]["name"]
    group, group_labels = _group_labels(name, revision, index)
    template = pod_template(body, group, cluster_domain)
    template["metadata"]["labels"].update(group_labels)
    return _stamp({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(body, group, group_labels),
        "spec": {
            "replicas": body["spec"]["parallelism"]["pipeline"],
            "serviceName": headless_name(name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": {L_DEPLOYMENT: name, L_GROUP: group}},
            "template": template,
        },
    })


def group_network_policy(body: dict[str, Any], revision: str, index: int) -> dict[str, Any]:
    """Only the group's own pods reach its pods, but for the HTTP port (traffic, probes,
    scraping): the rendezvous store (DIST_PORT) is unauthenticated, and the ranks' gloo/NCCL
    connections use ports of their own."""
    name = body["metadata"]["name"]
    group, group_labels = _group_labels(name, revision, index)
    mine = {"matchLabels": {L_DEPLOYMENT: name, L_GROUP: group}}
    return _stamp({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(body, group, group_labels),
        "spec": {
            "podSelector": mine,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": HTTP_PORT}]},
                {"from": [{"podSelector": mine}]},
            ],
        },
    })


def model_cache_pvc(body: dict[str, Any]) -> dict[str, Any]:
    """The deployment's shared model cache (spec.model.cache): every group mounts it read-only."""
    name = body["metadata"]["name"]
    cache = body["spec"]["model"]["cache"]
    spec: dict[str, Any] = {"accessModes": [cache["accessMode"]],
                            "resources": {"requests": {"storage": cache["size"]}}}
    if cache.get("storageClassName"):
        spec["storageClassName"] = cache["storageClassName"]
    return _stamp({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": _meta(body, model_cache_name(name), {"shoal.dev/model-cache": "true"}),
        "spec": spec,
    })


def model_fetch_job(body: dict[str, Any]) -> dict[str, Any]:
    """The Job that downloads the current (source, revision) into the shared cache, once."""
    spec = body["spec"]
    return _fetch_job(body, spec["model"]["source"][len("hf://"):], spec["model"], model_cache_key(spec))


def adapter_fetch_job(body: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The Job that downloads an hf:// adapter into the shared cache, once (its `main`)."""
    model = {**body["spec"]["model"], "revision": "main"}   # the model's token, the adapter's revision
    return _fetch_job(body, plan["source"][len("hf://"):], model, plan["cacheKey"])


def _fetch_job(body: dict[str, Any], repo: str, model: dict[str, Any], key: str) -> dict[str, Any]:
    name, spec = body["metadata"]["name"], body["spec"]
    tpl = pod_template(body, None)["spec"]
    user = spec.get("podTemplate") or {}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": tpl["securityContext"],
        "enableServiceLinks": False,
        "containers": [{
            "name": "fetch-model",
            "image": defaults.image_for(spec),
            "command": ["python3", "-c", FETCH_SCRIPT],
            "env": _fetch_env(model, repo, posixpath.join(MODEL_MOUNT, repo, key)),
            "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_MOUNT}]
                            + [{"name": v, "mountPath": p} for v, p in WRITABLE_DIRS],
            "securityContext": tpl["containers"][0]["securityContext"],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": model_cache_name(name)}}]
                   + [{"name": v, "emptyDir": {"sizeLimit": WRITABLE_DIR_SIZE}} for v, _ in WRITABLE_DIRS],
    }
    for key_ in ("nodeSelector", "tolerations", "imagePullSecrets", "priorityClassName"):
        if user.get(key_):
            pod[key_] = copy.deepcopy(user[key_])
    labels = {"shoal.dev/model-cache": "true", "shoal.dev/model-key": key}
    return _stamp({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(body, f"{name}-fetch-{key}", labels),
        "spec": {
            "backoffLimit": 4,
            # Done jobs (and their pods) go after an hour: status keeps the Ready; a failed one is
            # then created again, which is a retry.
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": {**common_labels(name), **labels}}, "spec": pod},
        },
    })


def volcano_pod_group(body: dict[str, Any], revision: str, index: int) -> dict[str, Any]:
    """placement.gangScheduling Volcano: the group's PodGroup (all `pipeline` pods or none)."""
    group, group_labels = _group_labels(body["metadata"]["name"], revision, index)
    return _stamp({
        "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
        "metadata": _meta(body, group, group_labels),
        "spec": {"minMember": body["spec"]["parallelism"]["pipeline"]},
    })


# Objects that live and die with one group: (apiVersion, kind) and how to render them.
COMPANION_KINDS = (("networking.k8s.io/v1", "NetworkPolicy"), ("scheduling.volcano.sh/v1beta1", "PodGroup"))


def group_companions(body: dict[str, Any], revision: str, index: int) -> list[dict[str, Any]]:
    """What a group needs besides its StatefulSet, created before it and deleted with it."""
    out = [group_network_policy(body, revision, index)]
    if body["spec"]["placement"]["gangScheduling"] == "Volcano":
        out.append(volcano_pod_group(body, revision, index))
    return out


def headless_service(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(body, headless_name(name), {L_SERVICE: "headless"}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "dist", "port": DIST_PORT, "targetPort": "dist", "protocol": "TCP"},
            ],
        },
    })


def traffic_service(body: dict[str, Any]) -> dict[str, Any]:
    """`NAME`, what clients call: the router pods (mode shoal) or the ready leaders (mode service)."""
    name = body["metadata"]["name"]
    shoal = routing_mode(body["spec"]) == "shoal"
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(body, name, {L_SERVICE: "traffic"}),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name) if shoal else leader_selector_labels(name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def _disruption_budget(body: dict[str, Any], metadata: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """At most one of the selected pods voluntarily evicted at a time."""
    return _stamp({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })


def pod_disruption_budget(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return _disruption_budget(body, _meta(body, name), selector_labels(name))


def _relabelings() -> list[dict[str, Any]]:
    return [
        {"sourceLabels": ["__meta_kubernetes_pod_label_shoal_dev_deployment"], "targetLabel": "inference_deployment"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_shoal_dev_group"], "targetLabel": "group"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_shoal_dev_revision"], "targetLabel": "revision"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index"], "targetLabel": "pipeline_rank"},
    ]


def service_monitor(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    mon = body["spec"]["monitoring"]
    return _stamp({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": _meta(body, name, dict(mon.get("labels") or {})),
        "spec": {
            # the Service over the leaders: `NAME` itself only where it selects them (mode service)
            "selector": {"matchLabels": {L_DEPLOYMENT: name, L_SERVICE: leader_service_label(body["spec"])}},
            "namespaceSelector": {"matchNames": [body["metadata"].get("namespace") or "default"]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": mon["interval"],
                           "relabelings": _relabelings()}],
        },
    })


def pod_monitor(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    mon = body["spec"]["monitoring"]
    return _stamp({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": _meta(body, f"{name}-pods", dict(mon.get("labels") or {})),
        "spec": {
            # workers only: leaders are scraped once, by the ServiceMonitor over the traffic Service
            "selector": {"matchLabels": selector_labels(name),
                         "matchExpressions": [{"key": L_POD_INDEX, "operator": "NotIn", "values": ["0"]}]},
            "namespaceSelector": {"matchNames": [body["metadata"].get("namespace") or "default"]},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": mon["interval"],
                                     "relabelings": _relabelings()}],
        },
    })


# ---------------------------------------------------------------- routing (spec.routing)

ROUTER_STARTUP_SECONDS = 600    # loading a tokenizer (after the init container fetched it)
ROUTER_FILES_SIZE = "1Gi"
# The router needs the model's config and tokenizer, not its weights: for hf:// it fetches
# only these (a separate script: FETCH_SCRIPT is part of the groups' revision hash).
ROUTER_FILE_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
ROUTER_FETCH_SCRIPT = _fetch_script(f", allow_patterns={ROUTER_FILE_PATTERNS!r}")
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"

# Every routing object any mode renders: (apiVersion, kind, name suffix); a mode switch
# deletes those the new mode does not render (routing_objects_absent).
ROUTING_KINDS = (
    ("apps/v1", "Deployment", "-router"),
    ("v1", "Service", ""),
    ("v1", "Service", "-leaders"),
    ("policy/v1", "PodDisruptionBudget", "-router"),
    ("monitoring.coreos.com/v1", "PodMonitor", "-router"),
    (INFERENCE_POOL_API, "InferencePool", ""),
)


def router_selector_labels(name: str) -> dict[str, str]:
    return {L_ROUTER: name}


def router_labels(name: str) -> dict[str, str]:
    """The router pods' labels. Not `shoal.dev/deployment`: that label selects the groups' pods
    (the headless Service, the groups' PodDisruptionBudget and spread constraints, the
    operator's pod watch), and a pod under two PodDisruptionBudgets cannot be evicted."""
    labels = {k: v for k, v in common_labels(name).items() if k != L_DEPLOYMENT}
    return {**labels, "app.kubernetes.io/component": "router", **router_selector_labels(name)}


def leader_service_label(spec: dict[str, Any]) -> str:
    """`shoal.dev/service` of the Service over the leaders (what the ServiceMonitor selects)."""
    return "traffic" if routing_mode(spec) == "service" else "leaders"


def _number(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def router_args(body: dict[str, Any], model_arg: str, cluster_domain: str = "cluster.local") -> list[str]:
    spec, name = body["spec"], body["metadata"]["name"]
    namespace = body["metadata"].get("namespace") or "default"
    router = spec["routing"]["router"]
    args = [
        "router",
        # the headless Service's A records: one per ready leader, so one per ready group
        "--backends-from-dns", f"{leaders_name(name)}.{namespace}.svc.{cluster_domain}:{HTTP_PORT}",
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--model", model_arg,
        "--served-model-name", spec["model"].get("servedName") or name,
        "--max-pending", str(router["maxPending"]),
        "--pending-timeout", str(router["pendingTimeoutSeconds"]),
    ]
    for key, flag in (("prefixWeight", "--prefix-weight"), ("loadWeight", "--load-weight"),
                      ("sessionHeader", "--session-header")):
        if router.get(key) is not None:   # unset: the router's own default
            args += [flag, _number(router[key])]
    return args


def router_model_plan(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """What the router pod gets of the model: the groups' plan, but for hf:// only the config
    and tokenizer files, fetched into its own emptyDir (never the weights, never the shared
    cache, which may not be filled yet or mountable on the router's node)."""
    source = spec["model"]["source"]
    if not source.startswith("hf://"):
        return model_plan(spec, name)   # builtin:// and file:// are in the image; pvc:// is mounted
    repo = source[len("hf://"):]
    target = posixpath.join(MODEL_MOUNT, repo)
    return {
        "arg": target,
        "volumes": [{"name": "model-cache", "emptyDir": {"sizeLimit": ROUTER_FILES_SIZE}}],
        "mounts": [{"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": True}],
        "init": [{
            "name": "fetch-tokenizer",
            "command": ["python3", "-c", ROUTER_FETCH_SCRIPT],
            "env": _fetch_env(spec["model"], repo, target),
            "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_MOUNT}],
        }],
    }


def router_deployment(body: dict[str, Any], cluster_domain: str = "cluster.local") -> dict[str, Any]:
    """`NAME-router`: the Shoal router pods (`shoal router`, same image as the groups)."""
    name, spec = body["metadata"]["name"], body["spec"]
    router = spec["routing"]["router"]
    user = spec.get("podTemplate") or {}
    model = router_model_plan(spec, name)
    security = _container_security()
    resources = {part: dict(router["resources"][part])
                 for part in ("requests", "limits") if (router.get("resources") or {}).get(part)}
    writable = [{"name": v, "mountPath": p} for v, p in WRITABLE_DIRS]
    container: dict[str, Any] = {
        "name": "router",
        "image": defaults.image_for(spec),
        "command": ["shoal"],
        "args": router_args(body, model["arg"], cluster_domain),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": resources,
        **_probes(startup_period=5, startup_seconds=ROUTER_STARTUP_SECONDS, startup_timeout=3),
        "volumeMounts": writable + model["mounts"],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if user.get("imagePullPolicy"):
        container["imagePullPolicy"] = user["imagePullPolicy"]
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": v, "emptyDir": {"sizeLimit": WRITABLE_DIR_SIZE}} for v, _ in WRITABLE_DIRS]
                   + model["volumes"],
        # It finds the groups through DNS, not the Kubernetes API: no token.
        "automountServiceAccountToken": False,
        # a held request may wait pendingTimeoutSeconds before it is answered
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS + router["pendingTimeoutSeconds"] + GRACE_MARGIN_SECONDS,
        "securityContext": _pod_security(),
        "enableServiceLinks": False,
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": router_selector_labels(name)}}],
    }
    if model["init"]:
        pod_spec["initContainers"] = [
            {**ic, "volumeMounts": list(ic["volumeMounts"]) + writable, "image": container["image"],
             "securityContext": security, "resources": {}} for ic in model["init"]]
    # The same image as the groups, so the same pull secrets; not their placement (GPU nodes).
    for key in ("imagePullSecrets", "priorityClassName"):
        if user.get(key):
            pod_spec[key] = copy.deepcopy(user[key])
    template = {"metadata": {"labels": router_labels(name), "annotations": scrape_annotations(spec)},
                "spec": pod_spec}
    if not template["metadata"]["annotations"]:
        del template["metadata"]["annotations"]
    return _stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(body, router_name(name), {"app.kubernetes.io/component": "router"}),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    })


def leaders_service(body: dict[str, Any]) -> dict[str, Any]:
    """`NAME-leaders`: headless, over the *ready* leaders (one per ready group): the router
    resolves its A records to find the groups; the ServiceMonitor scrapes through it."""
    name = body["metadata"]["name"]
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(body, leaders_name(name), {L_SERVICE: "leaders"}),
        "spec": {
            "clusterIP": "None",
            "selector": leader_selector_labels(name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def router_disruption_budget(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return _disruption_budget(body, _meta(body, router_name(name), {"app.kubernetes.io/component": "router"}),
                              router_selector_labels(name))


def router_pod_monitor(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    mon = body["spec"]["monitoring"]
    return _stamp({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": _meta(body, router_name(name), dict(mon.get("labels") or {})),
        "spec": {
            "selector": {"matchLabels": router_selector_labels(name)},
            "namespaceSelector": {"matchNames": [body["metadata"].get("namespace") or "default"]},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": mon["interval"],
                                     "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_shoal_dev_router"],
                                                      "targetLabel": "inference_deployment"}]}],
        },
    })


def inference_pool(body: dict[str, Any]) -> dict[str, Any]:
    """`NAME`: an InferencePool (Gateway API inference extension, v1) over the group leaders;
    the leaders export vLLM's metric names, which its endpoint picker reads."""
    name = body["metadata"]["name"]
    picker = body["spec"]["routing"]["inferencePool"]["endpointPicker"]
    return _stamp({
        "apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
        "metadata": _meta(body, name),
        "spec": {
            "selector": {"matchLabels": leader_selector_labels(name)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": picker["name"],
                                  "port": {"number": picker["port"]}, "failureMode": picker["failureMode"]},
        },
    })


def routing_objects(body: dict[str, Any], cluster_domain: str = "cluster.local") -> list[dict[str, Any]]:
    """What stands in front of the groups, by spec.routing.mode."""
    spec = body["spec"]
    mode = routing_mode(spec)
    if mode == "service":
        return [traffic_service(body)]
    if mode == "inferencePool":
        return [leaders_service(body), inference_pool(body)]
    objs = [router_deployment(body, cluster_domain), traffic_service(body), leaders_service(body),
            router_disruption_budget(body)]
    if spec["monitoring"]["serviceMonitor"]:
        objs.append(router_pod_monitor(body))
    return objs


def routing_objects_absent(body: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the routing objects the current mode does not render
    (those of another mode, after a switch; the router's PodMonitor with monitoring off)."""
    name = body["metadata"]["name"]
    wanted = {(o["kind"], o["metadata"]["name"]) for o in routing_objects(body)}
    return [(api, kind, name + suffix) for api, kind, suffix in ROUTING_KINDS
            if (kind, name + suffix) not in wanted]


def shared_objects(body: dict[str, Any], cluster_domain: str = "cluster.local") -> list[dict[str, Any]]:
    """The objects that do not depend on groups (Services, PDB, routing, monitors)."""
    objs = [headless_service(body), pod_disruption_budget(body)] + routing_objects(body, cluster_domain)
    if uses_model_cache(body["spec"]):
        objs.append(model_cache_pvc(body))
    if body["spec"]["monitoring"]["serviceMonitor"]:
        objs += [service_monitor(body), pod_monitor(body)]
    return objs


@dataclasses.dataclass(frozen=True)
class Desired:
    """One (defaulted) resource as the controller needs it: what to write, what to look for."""
    body: dict[str, Any]
    cluster_domain: str
    revision: str
    shared: list[dict[str, Any]]              # the objects the groups share, to apply
    absent: list[tuple[str, str, str]]        # (apiVersion, kind, name): switched off or another routing mode
    labels: dict[str, str]                    # every child's (to list them)
    selector: str                             # status.selector: one leader per group
    url: str | None                           # status.url; None with an InferencePool
    router: tuple[str, dict[str, str]] | None  # mode shoal: the router Deployment's name, its pods' labels
    cache_key: str | None                     # with the shared model cache: what it must hold
    companion_kinds: tuple[tuple[str, str], ...] = COMPANION_KINDS
    adapters: list[dict[str, Any]] | None = None   # with model.adapters: adapter_plan of each

    def group(self, index: int) -> list[dict[str, Any]]:
        """A group's objects in the order to create them: companions first, the StatefulSet last."""
        return group_companions(self.body, self.revision, index) + [
            group_statefulset(self.body, self.revision, index, self.cluster_domain)]

    def fetch_job(self) -> dict[str, Any]:
        return model_fetch_job(self.body)

    def adapter_fetch_job(self, plan: dict[str, Any]) -> dict[str, Any]:
        return adapter_fetch_job(self.body, plan)


def desired(body: dict[str, Any], cluster_domain: str = "cluster.local") -> Desired:
    spec, name = body["spec"], body["metadata"]["name"]
    mode = routing_mode(spec)
    return Desired(
        body=body, cluster_domain=cluster_domain, revision=revision_hash(body),
        shared=shared_objects(body, cluster_domain),
        absent=routing_objects_absent(body) + ([] if spec["monitoring"]["serviceMonitor"] else [  # monitoring off
            ("monitoring.coreos.com/v1", "ServiceMonitor", name),
            ("monitoring.coreos.com/v1", "PodMonitor", f"{name}-pods")]),
        labels=selector_labels(name), selector=selector(name),
        url=None if mode == "inferencePool" else
        serving_url(name, body["metadata"].get("namespace") or "default", cluster_domain),
        router=(router_name(name), router_selector_labels(name)) if mode == "shoal" else None,
        cache_key=model_cache_key(spec) if uses_model_cache(spec) else None,
        adapters=adapter_plans(spec) if lora_enabled(spec) else None)


def render_all(body: dict[str, Any], cluster_domain: str = "cluster.local") -> list[dict[str, Any]]:
    """Everything the controller creates for a fresh resource (defaults applied first)."""
    body = defaults.apply_defaults(body)
    d = desired(body, cluster_domain)
    fetch = [d.fetch_job()] if d.cache_key else []
    return d.shared + fetch + [obj for i in range(autoscale.desired_replicas(body)) for obj in d.group(i)]
