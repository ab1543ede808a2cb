"""The CRD: a valid apiextensions/v1 object with a structural schema; samples pass it, bad resources fail.

The API server's schema validation is reproduced with `jsonschema` after converting the
structural schema (unknown fields rejected, as `kubectl apply --validate=strict` does).
The CEL `x-kubernetes-validations` rules are evaluated by the test itself, with the
cel-python interpreter running the very rule strings the CRD carries (the API server is
not here to run them).
"""

from __future__ import annotations

import copy
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shoal.operator import crd, defaults
from shoal.operator import operator_cli as cli
from shoal_op_helpers import ROOT, make_body

celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")

CRD_FILE = ROOT / "crds" / "shoal.dev_inferencedeployments.yaml"


def to_jsonschema(s: dict) -> dict:
    """Structural OpenAPI v3 -> JSON Schema: drop x-kubernetes-* keys, reject unknown fields."""
    out = {}
    for k, v in s.items():
        if k.startswith("x-kubernetes-"):
            continue
        if k == "properties":
            out[k] = {name: to_jsonschema(sub) for name, sub in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = to_jsonschema(v)
        elif k == "anyOf":
            out[k] = [to_jsonschema(x) for x in v]
        else:
            out[k] = v
    if s.get("type") == "object" and "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if s.get("x-kubernetes-int-or-string"):
        out.pop("pattern", None)  # the pattern applies to the string form only
        out["anyOf"] = [{"type": "integer"}, {"type": "string", "pattern": s.get("pattern", ".*")}]
    return out


def cel_rules(schema: dict, path: tuple = ()):
    """Yield (path, rule) for every x-kubernetes-validations entry."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, path + (name,))


def cel_errors(obj: dict, schema: dict) -> list[str]:
    env = celpy.Environment()
    errors = []
    for path, rule in cel_rules(schema):
        node = obj
        for p in path:
            if not isinstance(node, dict) or p not in node:
                node = None
                break
            node = node[p]
        if node is None:
            continue  # rules apply only where the field is present
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
            errors.append(rule["message"])
    return errors


def validate_resource(obj: dict) -> None:
    """What the API server does on create: default, check the schema, run the CEL rules."""
    schema = crd.openapi_schema()
    defaulted = defaults.apply_defaults(obj, schema)
    jsonschema.validate(defaulted, to_jsonschema(schema))
    errors = cel_errors(defaulted, schema)
    if errors:
        raise jsonschema.ValidationError("; ".join(errors))


def test_crd_file_is_generated_from_the_code():
    assert CRD_FILE.read_text() == cli.crd_yaml(), "regenerate: shoal operator crd > " + str(CRD_FILE)


def test_crd_validates_as_apiextensions_v1():
    obj = yaml.safe_load(CRD_FILE.read_text())
    kubernetes_validate.validate(obj, "1.30.0", strict=True)
    v = obj["spec"]["versions"][0]
    assert obj["spec"]["names"]["shortNames"] == ["infd"]
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    assert v["subresources"]["status"] == {}
    cols = {c["name"] for c in v["additionalPrinterColumns"]}
    assert {"Model", "Replicas", "Ready", "Queue", "Age"} <= cols


def _structural(s: dict, path: str = "") -> None:
    if s.get("x-kubernetes-int-or-string"):
        assert [x["type"] for x in s["anyOf"]] == ["integer", "string"], path
        return
    assert "type" in s, f"no type at {path or '/'}"
    for name, sub in (s.get("properties") or {}).items():
        _structural(sub, f"{path}.{name}")
    if isinstance(s.get("items"), dict):
        _structural(s["items"], f"{path}[]")
    if isinstance(s.get("additionalProperties"), dict):
        _structural(s["additionalProperties"], f"{path}{{}}")
    if "default" in s:  # defaults must themselves be valid
        jsonschema.validate(defaults.apply_defaults(copy.deepcopy(s["default"]), s), to_jsonschema(s))


def test_schema_is_structural_with_defaults_and_bounds():
    schema = crd.openapi_schema()
    _structural(schema)
    spec = schema["properties"]["spec"]["properties"]
    assert spec["parallelism"]["properties"]["tensor"]["minimum"] == 1
    assert spec["parallelism"]["properties"]["pipeline"]["minimum"] == 1
    assert {r["rule"] for _, r in cel_rules(schema)} >= {"self.minReplicas <= self.maxReplicas"}


def test_samples_validate(sample):
    validate_resource(sample)


def test_minimal_resource_gets_the_documented_defaults():
    d = defaults.apply_defaults(make_body())["spec"]
    assert d["replicas"] == 1
    assert d["parallelism"] == {"tensor": 1, "pipeline": 1}
    assert d["engine"]["maxNumSeqs"] == 256 and d["engine"]["schedulingPolicy"] == "fcfs"
    assert d["engine"]["enablePrefixCaching"] is True and d["engine"]["blockSize"] == 16
    assert d["autoscaling"]["targetQueueDepth"] == 32 and d["autoscaling"]["scaleDownStabilizationSeconds"] == 300
    assert d["rollout"] == {"maxSurge": 1, "maxUnavailable": 0, "partition": 0}
    assert d["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert d["placement"]["colocateGroup"] == "Preferred" and d["placement"]["gangScheduling"] == "None"
    assert d["model"]["revision"] == "main"
    validate_resource(make_body())


BAD = {
    "pipeline 0": {"parallelism": {"pipeline": 0}},
    "tensor 0": {"parallelism": {"tensor": 0}},
    "min > max": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
    "unknown scheme": {"model": {"source": "s3://bucket/model"}},
    "no scheme": {"model": {"source": "/models/x"}},
    "hf without name": {"model": {"source": "hf://org"}},
    "surge and unavailable 0": {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
    "negative replicas": {"replicas": -1},
    "unknown field": {"replicaz": 3},
    "bad policy": {"engine": {"schedulingPolicy": "lifo"}},
    "batch < seqs": {"engine": {"maxNumSeqs": 4096, "maxNumBatchedTokens": 1024}},
    # issue 19: inputs that were accepted and then silently changed or broke the children
    "gpus != tensor": {"parallelism": {"tensor": 2}, "resources": {"limits": {"nvidia.com/gpu": 4}}},
    "gpu request != tensor": {"resources": {"requests": {"amd.com/gpu": "2"}}},
    "mig != tensor": {"parallelism": {"tensor": 2}, "resources": {"limits": {"nvidia.com/mig-3g.40gb": 1}}},
    "extraArgs --port": {"engine": {"extraArgs": ["--port", "9000"]}},
    "extraArgs --port=": {"engine": {"extraArgs": ["--port=9000"]}},
    "extraArgs abbreviated": {"engine": {"extraArgs": ["--tensor-parallel", "4"]}},
    "extraArgs -tp": {"engine": {"extraArgs": ["-tp", "4"]}},
    "extraArgs pp": {"engine": {"extraArgs": ["--pipeline-parallel-size=2"]}},
    "extraArgs host": {"engine": {"extraArgs": ["--host", "127.0.0.1"]}},
    "volume dshm": {"podTemplate": {"volumes": [{"name": "dshm", "emptyDir": {}}]}},
    "second /dev/shm": {"podTemplate": {"volumes": [{"name": "shm2", "emptyDir": {}}],
                                        "volumeMounts": [{"name": "shm2", "mountPath": "/dev/shm"}]}},
    "SHOAL_ env": {"podTemplate": {"env": [{"name": "SHOAL_PIPELINE_RANK", "value": "3"}]}},
    "env without name": {"podTemplate": {"env": [{"value": "3"}]}},
    "negative cacheSize": {"model": {"source": "hf://org/m", "cacheSize": "-10Gi"}},
    "negative cacheSize int": {"model": {"source": "hf://org/m", "cacheSize": -1}},
    "negative limit": {"resources": {"limits": {"memory": "-1Gi"}}},
    "pvc ..": {"model": {"source": "pvc://models/../../etc"}},
    "pvc .. end": {"model": {"source": "pvc://models/a/.."}},
    "interval 0s": {"monitoring": {"interval": "0s"}},
    "interval 00m": {"monitoring": {"interval": "00m"}},
    "volume tmp": {"podTemplate": {"volumes": [{"name": "tmp", "emptyDir": {}}]}},
    "second /tmp": {"podTemplate": {"volumes": [{"name": "t", "emptyDir": {}}],
                                    "volumeMounts": [{"name": "t", "mountPath": "/tmp"}]}},
    "pvc with a model cache": {"model": {"source": "pvc://models/x", "cache": {"enabled": True}}},
    "negative cache size": {"model": {"source": "hf://org/m", "cache": {"enabled": True, "size": "-1Gi"}}},
    # issue 31: LoRA adapters
    "adapter s3": {"model": {"source": "builtin://smollm2-135m-instruct",
                             "adapters": [{"name": "sql", "source": "s3://bucket/sql"}]}},
    "adapter builtin": {"model": {"source": "builtin://smollm2-135m-instruct",
                                  "adapters": [{"name": "sql", "source": "builtin://smollm2-135m-instruct"}]}},
    "adapter pvc without path": {"model": {"source": "hf://org/m", "adapters": [{"name": "sql", "source": "pvc://ads"}]}},
    "adapter twice": {"model": {"source": "hf://org/m", "adapters": [{"name": "sql", "source": "hf://org/sql"},
                                                                    {"name": "sql", "source": "hf://org/sql2"}]}},
    "adapter ..": {"model": {"source": "hf://org/m", "adapters": [{"name": "sql", "source": "pvc://ads/../etc"}]}},
    "adapter named as the model": {"model": {"source": "hf://org/m", "adapters": [{"name": "demo",
                                                                                   "source": "hf://org/sql"}]}},
    "adapter named as servedName": {"model": {"source": "hf://org/m", "servedName": "llama",
                                              "adapters": [{"name": "llama", "source": "hf://org/sql"}]}},
    "adapter name with =": {"model": {"source": "hf://org/m", "adapters": [{"name": "a=b", "source": "hf://org/sql"}]}},
    "adapter without source": {"model": {"source": "hf://org/m", "adapters": [{"name": "sql"}]}},
    "adapter volume name": {"podTemplate": {"volumes": [{"name": "adapter-1", "emptyDir": {}}]}},
    "adapter mount": {"podTemplate": {"volumes": [{"name": "a", "emptyDir": {}}],
                                      "volumeMounts": [{"name": "a", "mountPath": "/adapters"}]}},
}

GOOD = {
    "gpus == tensor": {"parallelism": {"tensor": 2}, "resources": {"limits": {"nvidia.com/gpu": 2}}},
    "mig == tensor": {"resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}},
    "cpu and memory": {"resources": {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": 4}}},
    "other extraArgs": {"engine": {"extraArgs": ["--max-num-partial-prefills", "2", "--trust-remote-code",
                                                 "--pipeline-layer-split", "3,3"]}},
    "own volumes": {"podTemplate": {"volumes": [{"name": "certs", "secret": {"secretName": "c"}}],
                                    "volumeMounts": [{"name": "certs", "mountPath": "/etc/certs"}],
                                    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}},
    "pvc dotted names": {"model": {"source": "pvc://models/llama..v2/a.b"}},
    "interval 10s": {"monitoring": {"interval": "10s"}},
    "cacheSize": {"model": {"source": "hf://org/m", "cacheSize": "20Gi"}},
    "model cache": {"model": {"source": "hf://org/m", "cache": {"enabled": True, "accessMode": "ReadWriteOnce"}}},
    "adapters": {"model": {"source": "hf://org/m", "servedName": "llama", "adapters": [
        {"name": "sql", "source": "hf://org/sql-lora"}, {"name": "chat.v2", "source": "pvc://adapters/chat/v2"},
        {"name": "demo-x", "source": "file:///opt/adapters/x"}]}},
    "no adapters yet": {"model": {"source": "hf://org/m", "adapters": []}},
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_resources_pass(case):
    validate_resource(make_body(**GOOD[case]))


def test_unknown_status_fields_are_not_kept():
    # kopf keeps its state in annotations: status has no free-form room left.
    assert not crd.openapi_schema()["properties"]["status"].get("x-kubernetes-preserve-unknown-fields")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_resources_fail(case):
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(make_body(**BAD[case]))


def test_too_long_a_name_fails():
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(make_body(name="x" * (crd.MAX_NAME_LENGTH + 1)))
    validate_resource(make_body(name="x" * crd.MAX_NAME_LENGTH))


@pytest.mark.parametrize("name", ["llama.v2", "8b-llama", "Llama", "llama-", "-llama", "llama_2"])
def test_names_that_break_children_fail(name):
    # Issue 19, defect 3: dots break Service/StatefulSet names, a Service name starts with a letter.
    with pytest.raises(jsonschema.ValidationError, match="DNS label"):
        validate_resource(make_body(name=name))


@pytest.mark.parametrize("name", ["llama-v2", "l", "llama3-8b"])
def test_dns_label_names_pass(name):
    validate_resource(make_body(name=name))


@pytest.mark.parametrize("source", ["builtin://smollm2-135m-instruct", "hf://meta-llama/Llama-3.1-8B",
                                    "pvc://models", "pvc://models/llama/8b", "file:///opt/m"])
def test_known_sources_pass(source):
    assert re.match(crd.SOURCE_PATTERN, source)
    validate_resource(make_body(model={"source": source}))


@pytest.mark.parametrize("case, message", [
    ("adapter twice", crd.RULE_ADAPTER_NAMES["message"]),
    ("adapter ..", crd.RULE_ADAPTER_PATHS["message"]),
    ("adapter named as the model", crd.RULE_ADAPTER_NOT_BASE["message"]),
    ("adapter named as servedName", crd.RULE_ADAPTER_NOT_BASE["message"]),
])
def test_adapter_rules_are_the_ones_that_refuse(case, message):
    # These pass the schema: the CEL rule (run by cel-python) is what refuses them.
    body = defaults.apply_defaults(make_body(**BAD[case]), crd.openapi_schema())
    jsonschema.validate(body, to_jsonschema(crd.openapi_schema()))
    assert message in cel_errors(body, crd.openapi_schema())


def test_adapter_names_are_a_map_list():
    # The API server itself refuses a duplicate key of a map list, before any CEL rule.
    adapters = crd.openapi_schema()["properties"]["spec"]["properties"]["model"]["properties"]["adapters"]
    assert adapters["x-kubernetes-list-type"] == "map" and adapters["x-kubernetes-list-map-keys"] == ["name"]
