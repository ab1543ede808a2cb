"""The InferenceDeployment CustomResourceDefinition, as data.

This module is the single source of truth for the resource's schema: `crds/` holds
its YAML rendering (`shoal operator crd > crds/shoal.dev_inferencedeployments.yaml`,
checked by a test), and `defaults.apply_defaults` fills a spec from the very same
schema, so `shoal operator render` and the controller see exactly what the API server
would store.
"""

from __future__ import annotations

import copy
from typing import Any

GROUP = "shoal.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]
API_VERSION = f"{GROUP}/{VERSION}"

# Group names are `<name>-<revision>-<index>` and become StatefulSet names, whose
# pods carry `controller-revision-hash: <sts>-<10 chars>` (a 63-char label value):
# 38 + 1 + 8 + 1 + 3 = 51 <= 52.
MAX_NAME_LENGTH = 38
MAX_REPLICAS = 512

# Known model source schemes, anchored; used by the schema and by render.
SOURCE_PATTERN = (
    r"^(builtin://[a-z0-9][a-z0-9._-]*"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?"
    r"|file:///.+)$"
)

# LoRA adapters (spec.model.adapters): a PEFT directory, from where a model may come but
# the image's built-in models. A pvc:// adapter names its directory on the claim.
ADAPTER_SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^/].*"
    r"|file:///.+)$"
)
# What clients send as `model`; `--lora-modules NAME=PATH` splits on '='.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"
MAX_ADAPTERS = 64
# An adapter on one group: Loaded (its leader serves it), Fetching (the shared cache's Job
# still downloads it), Pending (the group is not ready, or its pods lack the adapter's
# files until it restarts), Failed (the leader refused it: the message says why).
ADAPTER_STATES = ("Loaded", "Fetching", "Pending", "Failed")

# CEL rules, by the schema path they sit on (the tests evaluate these same strings).
RULE_NAME = {
    "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
    "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
               "(group StatefulSet names are derived from it)",
}
# Every child is named from it: Services need an RFC 1035 label (a letter first), and
# StatefulSets and pod hostnames a DNS label (no dots).
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RULE_NAME_FORMAT = {
    "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
    "message": "metadata.name must be a DNS label that starts with a letter (lower case letters, digits "
               "and '-'; no dots): it names Services and StatefulSets",
}
# Bad inputs refused by the API server (issue 19); validate.py applies the same rules in
# the operator, for a cluster whose CRD is older than the operator.
ACCELERATOR_RULE_KEY = "(k.endsWith('/gpu') || k.startsWith('nvidia.com/mig-'))"
RULE_ACCELERATORS = {
    "rule": " && ".join(
        f"(!has(self.resources) || !has(self.resources.{part}) || self.resources.{part}.all(k, "
        f"!{ACCELERATOR_RULE_KEY} || string(self.resources.{part}[k]) == string(self.parallelism.tensor)))"
        for part in ("limits", "requests")),
    "message": "an accelerator resource (*/gpu, nvidia.com/mig-*) must equal parallelism.tensor "
               "(each pod holds `tensor` ranks, one accelerator each)",
}
# Flags the operator sets itself, with every prefix argparse would accept for them.
RESERVED_FLAGS = ("port", "host", "tensor-parallel-size", "pipeline-parallel-size")
RESERVED_FLAG_PATTERN = (
    "^(--(" + "|".join(sorted({f[:i] for f in RESERVED_FLAGS for i in range(1, len(f) + 1)}, key=lambda x: (-len(x), x)))
    + ")(=.*)?|-(tp|pp).*)$"
)
RULE_EXTRA_ARGS = {
    "rule": f"!has(self.extraArgs) || self.extraArgs.all(a, !a.matches('{RESERVED_FLAG_PATTERN}'))",
    "message": "engine.extraArgs may not set --port, --host or the parallel sizes (the operator sets them "
               "from the spec)",
}
RESERVED_VOLUMES = ("dshm", "model", "model-cache", "tmp", "home")   # render.py's volumes
RESERVED_VOLUME_PREFIX = "adapter-"                                  # and the LoRA adapters'
RESERVED_MOUNTS = ("/tmp", "/home/shoal", "/models", "/adapters")    # and mounts, besides /dev/shm
RULE_VOLUMES = {
    "rule": "!has(self.volumes) || self.volumes.all(v, !(v.name in "
            + "[" + ", ".join(f"'{v}'" for v in RESERVED_VOLUMES) + f"]) && !v.name.startsWith('{RESERVED_VOLUME_PREFIX}'))",
    "message": "podTemplate.volumes: the names " + ", ".join(RESERVED_VOLUMES)
               + f" and {RESERVED_VOLUME_PREFIX}* are the operator's",
}
RULE_SHM_MOUNT = {
    "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, m.mountPath != '/dev/shm' "
            "&& !m.mountPath.startsWith('/dev/shm/'))",
    "message": "podTemplate.volumeMounts: /dev/shm is mounted by the operator (sized by parallelism.tensor)",
}
RULE_MOUNTS = {
    "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in "
            + "[" + ", ".join(f"'{p}'" for p in RESERVED_MOUNTS) + "]))",
    "message": "podTemplate.volumeMounts: " + ", ".join(RESERVED_MOUNTS) + " are mounted by the operator",
}
RESERVED_ENV_PREFIX = "SHOAL_"
RULE_ENV = {
    "rule": "!has(self.env) || self.env.all(e, !e.name.startsWith('SHOAL_'))",
    "message": "podTemplate.env: SHOAL_* names are reserved for the operator",
}
RULE_SOURCE_PATH = {
    "rule": "!self.source.matches('^(pvc|file)://(.*/)?[.][.](/.*)?$')",
    "message": "model.source: a path may not contain '..'",
}
RULE_CACHE_SOURCE = {
    "rule": "!has(self.cache) || !self.cache.enabled || self.source.startsWith('hf://')",
    "message": "model.cache is for hf:// sources (the others need no download)",
}
RULE_ADAPTER_NAMES = {
    "rule": "!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
    "message": "model.adapters: each name once (it is what clients send as `model`)",
}
RULE_ADAPTER_PATHS = {
    "rule": "!has(self.adapters) || self.adapters.all(a, !a.source.matches('^(pvc|file)://(.*/)?[.][.](/.*)?$'))",
    "message": "model.adapters: a path may not contain '..'",
}
# At the root: the resource's name is the served name by default.
RULE_ADAPTER_NOT_BASE = {
    "rule": "!has(self.spec.model.adapters) || self.spec.model.adapters.all(a, a.name != "
            "(has(self.spec.model.servedName) ? self.spec.model.servedName : self.metadata.name))",
    "message": "model.adapters: an adapter may not take the base model's served name",
}
RULE_MIN_MAX = {
    "rule": "self.minReplicas <= self.maxReplicas",
    "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
}
RULE_ROLLOUT = {
    "rule": "self.maxSurge > 0 || self.maxUnavailable > 0",
    "message": "rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
}
# spec.routing: scaling to zero needs a router in front to hold requests while no group runs.
RULE_SCALE_TO_ZERO = {
    "rule": "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || self.autoscaling.minReplicas > 0 "
            "|| !has(self.routing) || !has(self.routing.mode) || self.routing.mode == 'shoal'",
    "message": "autoscaling.minReplicas 0 needs routing.mode shoal (the Shoal router holds requests while "
               "no group runs; a plain Service or an InferencePool would refuse them)",
}
RULE_ENDPOINT_PICKER = {
    "rule": "!has(self.mode) || self.mode != 'inferencePool' || (has(self.inferencePool) && has(self.inferencePool.endpointPicker))",
    "message": "routing.mode inferencePool needs routing.inferencePool.endpointPicker (the InferencePool's "
               "endpointPickerRef is required)",
}
ROUTING_MODES = ("shoal", "service", "inferencePool")
RULE_BATCH = {
    "rule": "self.maxNumBatchedTokens >= self.maxNumSeqs",
    "message": "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs",
}


def _int(default: int | None = None, minimum: int | None = None, maximum: int | None = None,
         description: str = "") -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    if description:
        s["description"] = description
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _free_object(description: str = "") -> dict[str, Any]:
    s: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if description:
        s["description"] = description
    return s


def _named_list(description: str, *more: str) -> dict[str, Any]:
    """A list of core/v1 objects: the keys the CEL rules read are declared (and required),
    the rest is the API server's to check when the group's StatefulSet is created."""
    keys = ("name",) + more
    # Bounded (maxItems, maxLength) so the API server's CEL cost estimate of the rules stays
    # within its budget (an unbounded list of unbounded strings is refused at CRD install).
    item = {**_free_object(), "required": list(keys),
            "properties": {k: {"type": "string", "maxLength": 253 if k == "name" else 1024} for k in keys}}
    return {"type": "array", "description": description, "maxItems": 128, "items": item}


def _free_list(description: str = "") -> dict[str, Any]:
    return {"type": "array", "description": description, "items": _free_object()}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

# Non-negative quantities only (no sign; integers >= 0).
_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "minimum": 0,  # applies to the integer form
    "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


def spec_schema() -> dict[str, Any]:
    model = {
        "type": "object",
        "description": "What to serve.",
        "required": ["source"],
        "x-kubernetes-validations": [RULE_SOURCE_PATH, RULE_CACHE_SOURCE, RULE_ADAPTER_NAMES, RULE_ADAPTER_PATHS],
        "properties": {
            "source": {
                "type": "string",
                "description": "builtin://NAME, hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH",
                "pattern": SOURCE_PATTERN,
                "maxLength": 1024,
            },
            "revision": {"type": "string", "default": "main", "maxLength": 256,
                         "description": "Hugging Face revision (branch, tag or commit); any change rolls the groups"},
            "servedName": {"type": "string", "maxLength": 256,
                           "description": "the model name clients send; defaults to the resource name"},
            "tokenSecret": {
                "type": "object",
                "description": "Secret holding a Hugging Face token for hf:// sources",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "maxLength": 253},
                    "key": {"type": "string", "default": "token", "maxLength": 253},
                },
            },
            "adapters": {
                "type": "array",
                "description": "LoRA adapters of this model (PEFT directories), served beside it by every group. "
                               "Present (even empty): the groups run with --enable-lora. Changing the list "
                               "loads and unloads adapters on the running groups, without a rollout",
                "maxItems": MAX_ADAPTERS,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
                "items": {
                    "type": "object",
                    "required": ["name", "source"],
                    "properties": {
                        "name": {"type": "string", "pattern": ADAPTER_NAME_PATTERN, "maxLength": 63,
                                 "description": "what clients send as `model`"},
                        "source": {"type": "string", "pattern": ADAPTER_SOURCE_PATTERN, "maxLength": 1024,
                                   "description": "hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH"},
                    },
                },
            },
            "cacheSize": {**_QUANTITY, "description": "size limit of the hf:// download cache (emptyDir)"},
            "cache": {
                "type": "object",
                "description": "hf:// only: a shared cache (a PVC per deployment) that a Job fills once per "
                               "revision and every pod mounts read-only, instead of a download per pod",
                "properties": {
                    "enabled": {"type": "boolean", "default": False},
                    "size": {**_QUANTITY, "default": "100Gi"},
                    "storageClassName": {"type": "string", "maxLength": 253},
                    "accessMode": {"type": "string", "default": "ReadWriteMany",
                                   "enum": ["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"],
                                   "description": "ReadWriteMany for groups on several nodes"},
                },
            },
        },
    }
    parallelism = {
        "type": "object",
        "default": {},
        "description": "Group shape: `pipeline` pods of `tensor` accelerators (or processes) each.",
        "properties": {
            "tensor": _int(1, 1, 64, "tensor-parallel ranks per pod"),
            "pipeline": _int(1, 1, 64, "pipeline stages = pods per group"),
        },
    }
    engine = {
        "type": "object",
        "default": {},
        "description": "Runtime flags of `shoal serve`.",
        "x-kubernetes-validations": [RULE_BATCH, RULE_EXTRA_ARGS],
        "properties": {
            "maxNumSeqs": _int(256, 1, 65536),
            "maxNumBatchedTokens": _int(2048, 1, 1048576),
            "maxModelLen": _int(4096, 16, 1048576),
            "blockSize": {"type": "integer", "default": 16, "enum": [8, 16, 32, 64, 128]},
            "enablePrefixCaching": {"type": "boolean", "default": True},
            "schedulingPolicy": {"type": "string", "default": "fcfs", "enum": ["fcfs", "priority"]},
            "drainTimeoutSeconds": _int(60, 0, 3600, "how long in-flight requests may finish on SIGTERM"),
            "extraArgs": {"type": "array", "items": {"type": "string", "maxLength": 1024}, "maxItems": 64,
                          "description": "further `shoal serve` flags, appended verbatim"},
        },
    }
    resources = {
        "type": "object",
        "description": "Per-pod resources. Naming an accelerator (e.g. nvidia.com/gpu) sets its "
                       "limit to parallelism.tensor. Without one, a cpu or memory request with no "
                       "limit gets a limit equal to it (both: a Guaranteed pod).",
        "properties": {
            "requests": {"type": "object", "maxProperties": 32, "additionalProperties": _QUANTITY},
            "limits": {"type": "object", "maxProperties": 32, "additionalProperties": _QUANTITY},
        },
    }
    autoscaling = {
        "type": "object",
        "default": {},
        "x-kubernetes-validations": [RULE_MIN_MAX],
        "properties": {
            "enabled": {"type": "boolean", "default": False},
            "minReplicas": _int(1, 0, MAX_REPLICAS, "0 (scale to zero) needs routing.mode shoal"),
            "maxReplicas": _int(8, 1, MAX_REPLICAS),
            "targetQueueDepth": _int(32, 1, 1000000, "requests in flight per group to aim for"),
            "scaleUpStabilizationSeconds": _int(0, 0, 3600),
            "scaleDownStabilizationSeconds": _int(300, 0, 3600),
            "tolerance": {"type": "number", "default": 0.1, "minimum": 0, "maximum": 1},
        },
    }
    rollout = {
        "type": "object",
        "default": {},
        "x-kubernetes-validations": [RULE_ROLLOUT],
        "properties": {
            "maxSurge": _int(1, 0, MAX_REPLICAS, "groups above replicas during a rollout"),
            "maxUnavailable": _int(0, 0, MAX_REPLICAS, "ready groups below replicas during a rollout"),
            "partition": _int(0, 0, MAX_REPLICAS, "staged rollout: keep up to this many (ready) groups of "
                                                  "older revisions; lower it to go on (as LeaderWorkerSet's)"),
        },
    }
    placement = {
        "type": "object",
        "default": {},
        "description": "Where a group's pods run.",
        "properties": {
            "colocateGroup": {"type": "string", "default": "Preferred", "enum": ["Preferred", "Required", "None"],
                              "description": "pod affinity of a group's pods to each other within groupTopologyKey"},
            "groupTopologyKey": {"type": "string", "default": "topology.kubernetes.io/zone", "maxLength": 316,
                                 "description": "the domain a group's pods share (zone, rack, NVLink domain label)"},
            "spreadGroups": {"type": "boolean", "default": True,
                             "description": "spread groups across spreadTopologyKey (pods of the same rank apart)"},
            "spreadTopologyKey": {"type": "string", "default": "kubernetes.io/hostname", "maxLength": 316},
            "schedulerName": {"type": "string", "maxLength": 253,
                              "description": "opt-in scheduler (e.g. a gang scheduler) for every pod"},
            "gangScheduling": {"type": "string", "default": "None", "enum": ["None", "Kueue", "Volcano"],
                               "description": "Kueue: label each group as a Kueue pod group of `pipeline` pods "
                                              "(set kueue.x-k8s.io/queue-name in podTemplate.metadata.labels); "
                                              "Volcano: a PodGroup per group (minMember `pipeline`), "
                                              "schedulerName volcano unless set"},
        },
    }
    monitoring = {
        "type": "object",
        "default": {},
        "properties": {
            "serviceMonitor": {"type": "boolean", "default": False,
                               "description": "render a ServiceMonitor and a PodMonitor "
                                              "(prometheus-operator) instead of scrape annotations"},
            "interval": {"type": "string", "default": "15s", "pattern": r"^0*[1-9][0-9]*(ms|s|m|h)$",
                         "description": "scrape interval, > 0"},
            "labels": {**_STRING_MAP, "description": "extra labels on the monitors (e.g. release: prometheus)"},
        },
    }
    routing = {
        "type": "object",
        "default": {},
        "description": "What stands in front of the groups (the Service NAME clients call).",
        "x-kubernetes-validations": [RULE_ENDPOINT_PICKER],
        "properties": {
            "mode": {"type": "string", "default": "shoal", "enum": list(ROUTING_MODES),
                     "description": "shoal: a Shoal router (prefix- and load-aware; holds requests while scaled "
                                    "to zero); service: a plain Service over the group leaders; inferencePool: "
                                    "an InferencePool (inference.networking.k8s.io/v1) for the Gateway API "
                                    "inference extension"},
            "router": {
                "type": "object",
                "default": {},
                "description": "mode shoal: the router Deployment NAME-router",
                "properties": {
                    "replicas": _int(2, 1, 64, "router pods"),
                    "resources": {
                        "type": "object",
                        "description": "per router pod",
                        "properties": {
                            "requests": {"type": "object", "maxProperties": 32, "additionalProperties": _QUANTITY},
                            "limits": {"type": "object", "maxProperties": 32, "additionalProperties": _QUANTITY},
                        },
                    },
                    "prefixWeight": {"type": "number", "minimum": 0,
                                     "description": "weight of the prefix-cache match in the choice of a group "
                                                    "(the router's default when unset)"},
                    "loadWeight": {"type": "number", "minimum": 0,
                                   "description": "weight of a group's load (the router's default when unset)"},
                    "sessionHeader": {"type": "string", "maxLength": 256,
                                      "description": "requests with the same value of this header go to the same "
                                                     "group"},
                    "maxPending": _int(256, 0, 1000000, "requests the router holds while no group is ready"),
                    "pendingTimeoutSeconds": _int(60, 1, 3600, "how long a held request waits for a group"),
                },
            },
            "inferencePool": {
                "type": "object",
                "description": "mode inferencePool",
                "properties": {
                    "endpointPicker": {
                        "type": "object",
                        "description": "the endpoint picker extension's Service (endpointPickerRef)",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "maxLength": 253},
                            "port": _int(9002, 1, 65535, "its gRPC port"),
                            "failureMode": {"type": "string", "default": "FailClose",
                                            "enum": ["FailOpen", "FailClose"]},
                        },
                    },
                },
            },
        },
    }
    pod_template = {
        "type": "object",
        "default": {},
        "description": "Merged into every pod of every group.",
        "x-kubernetes-validations": [RULE_VOLUMES, RULE_SHM_MOUNT, RULE_MOUNTS, RULE_ENV],
        "properties": {
            "metadata": {
                "type": "object",
                "properties": {"labels": _STRING_MAP, "annotations": _STRING_MAP},
            },
            "nodeSelector": _STRING_MAP,
            "tolerations": _free_list("core/v1 Toleration"),
            "affinity": _free_object("core/v1 Affinity"),
            "topologySpreadConstraints": _free_list("core/v1 TopologySpreadConstraint"),
            "priorityClassName": {"type": "string"},
            "runtimeClassName": {"type": "string"},
            "schedulerName": {"type": "string"},
            "serviceAccountName": {"type": "string"},
            "imagePullSecrets": _free_list("core/v1 LocalObjectReference"),
            "env": _named_list("core/v1 EnvVar (SHOAL_* names are reserved)"),
            "envFrom": _free_list("core/v1 EnvFromSource"),
            "volumes": _named_list("core/v1 Volume (dshm, model, model-cache are reserved)"),
            "volumeMounts": _named_list("core/v1 VolumeMount (not at /dev/shm)", "mountPath"),
            "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
        },
    }
    return {
        "type": "object",
        "required": ["model"],
        "x-kubernetes-validations": [RULE_ACCELERATORS, RULE_SCALE_TO_ZERO],
        "properties": {
            "model": model,
            "replicas": _int(1, 0, MAX_REPLICAS, "pod groups (when autoscaling is off)"),
            "parallelism": parallelism,
            "engine": engine,
            "resources": resources,
            "image": {"type": "string", "maxLength": 512,
                      "description": "runtime image; defaults by accelerator (see docs/operator.md)"},
            "autoscaling": autoscaling,
            "rollout": rollout,
            "monitoring": monitoring,
            "placement": placement,
            "routing": routing,
            "restartPolicy": {"type": "string", "default": "RecreateGroupOnPodRestart",
                              "enum": ["RecreateGroupOnPodRestart", "None"],
                              "description": "RecreateGroupOnPodRestart: a failed pod or restarted container "
                                             "restarts its whole group (the ranks cannot rejoin a running "
                                             "group); None: the operator leaves it (reported as Degraded)"},
            "podTemplate": pod_template,
        },
    }


def _condition_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
    }


def status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "updatedReplicas": {"type": "integer"},
            "desiredReplicas": {"type": "integer"},
            "selector": {"type": "string"},
            "queueDepth": {"type": "integer"},
            "revision": {"type": "string"},
            "model": {"type": "string"},
            "url": {"type": "string", "description": "the traffic Service's URL (OpenAI API under /v1); "
                                                     "absent with routing.mode inferencePool (the Gateway's)"},
            "router": {
                "type": "object",
                "description": "routing.mode shoal: the router pods",
                "properties": {
                    "readyReplicas": {"type": "integer"},
                    "pendingRequests": {"type": "integer",
                                        "description": "requests the routers hold (no group ready yet)"},
                },
            },
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "revision": {"type": "string"},
                        "ready": {"type": "boolean"},
                        "pods": {"type": "integer", "description": "ready pods"},
                        "queueDepth": {"type": "integer"},
                        "restarts": {"type": "integer"},
                        "recentRestarts": {"type": "integer", "description": "restarts in the last hour"},
                        "lastRestartTime": {"type": "string", "format": "date-time"},
                        "readySince": {"type": "string", "format": "date-time"},
                        "terminating": {"type": "boolean"},
                    },
                },
            },
            "modelCache": {
                "type": "object",
                "description": "the shared model cache's download (spec.model.cache)",
                "properties": {
                    "phase": {"type": "string", "enum": ["Pending", "Fetching", "Ready", "Failed"]},
                    "key": {"type": "string", "description": "hash of the source and revision it holds"},
                    "job": {"type": "string"},
                    "message": {"type": "string"},
                    "startTime": {"type": "string", "format": "date-time"},
                    "completionTime": {"type": "string", "format": "date-time"},
                },
            },
            "adapters": {
                "type": "array",
                "description": "spec.model.adapters: each adapter's state on each group",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "source": {"type": "string"},
                        "loadedGroups": {"type": "integer", "description": "groups that serve it"},
                        "cache": {"type": "string", "enum": ["Pending", "Fetching", "Ready", "Failed"],
                                  "description": "hf:// with model.cache: its download into the shared cache"},
                        "groups": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string"},
                                    "state": {"type": "string", "enum": list(ADAPTER_STATES)},
                                    "message": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
            "autoscaler": {
                "type": "object",
                "description": "the autoscaler's state (stabilization window), kept across restarts",
                "properties": {
                    "recommendations": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"time": {"type": "string", "format": "date-time"},
                                           "replicas": {"type": "integer"},
                                           "seed": {"type": "boolean"}},
                        },
                    },
                    "lastScaleTime": {"type": "string", "format": "date-time"},
                    "lastDirection": {"type": "string"},
                },
            },
            "conditions": {
                "type": "array",
                "items": _condition_schema(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
        # No x-kubernetes-preserve-unknown-fields: kopf keeps its progress and diff base in
        # annotations (main.configure), so status holds only what is declared here.
    }


def crd() -> dict[str, Any]:
    root = {
        "type": "object",
        "description": "A served model: pod groups running `shoal serve`, rolled out and autoscaled.",
        "x-kubernetes-validations": [RULE_NAME, RULE_NAME_FORMAT, RULE_ADAPTER_NOT_BASE],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "shoal", "app.kubernetes.io/part-of": "shoal"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "shoal"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
                    {"name": "Replicas", "type": "integer", "jsonPath": ".status.desiredReplicas"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "Queue", "type": "integer", "jsonPath": ".status.queueDepth"},
                    {"name": "Available", "type": "string",
                     "jsonPath": ".status.conditions[?(@.type==\"Available\")].status"},
                    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def openapi_schema() -> dict[str, Any]:
    """The structural schema of the served version (a copy)."""
    return copy.deepcopy(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
