"""The inference-pool component (k8s/components/inference-pool): stagemesh gateways as an InferencePool's members.
Standard objects validate with kubernetes-validate --strict; the InferencePool is a custom resource whose CRD is not
in kubernetes-validate's schemas, so it is checked against SCHEMA, written from the upstream v1 API reference
(gateway-api-inference-extension site-src/reference/spec.md: InferencePoolSpec, LabelSelector, Port,
EndpointPickerRef). The endpoint picker's flags name only gauges the gateway exports, and its pool holds the gateway
pods, by readiness."""

import subprocess
import sys

import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.engine.metrics import POOL_METRICS, watch_replicas
from services.testing.k8s_render import find, render
from tests.test_replicas import replicas

BIN = f"{sys.prefix}/bin"
CUSTOM = {"inference.networking.k8s.io/v1"}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "targetPorts",
                                                                              "endpointPickerRef"],
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                                  "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                                 "maxProperties": 64,
                                                                 "additionalProperties": {"type": "string",
                                                                                          "maxLength": 63}}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": PORT},
                     "endpointPickerRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                           "properties": {"group": {"type": "string", "maxLength": 253},
                                                          "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                                                          "name": NAME, "port": PORT,
                                                          "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}}


@pytest.fixture(scope="module")
def docs():
    return render("inference-pool")


def test_standard_objects_validate_strictly_and_the_pool_against_its_schema(docs, tmp_path):
    standard = [d for d in docs if d["apiVersion"] not in CUSTOM]
    path = tmp_path / "standard.yaml"
    path.write_text(yaml.safe_dump_all(standard))
    proc = subprocess.run([f"{BIN}/kubernetes-validate", "--strict", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(standard) >= 18
    [pool] = [d for d in docs if d["apiVersion"] in CUSTOM]
    jsonschema.validate(pool, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):  # the schema can refuse: v1alpha2's field name is not v1's
        jsonschema.validate({**pool, "spec": {**pool["spec"], "targetPortNumber": 8000}}, SCHEMA)


def test_pool_members_are_the_gateway_pods_by_readiness(docs):
    pool = find(docs, "InferencePool", "stagemesh")["spec"]
    selector = pool["selector"]["matchLabels"]
    selected = [d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert selected == ["stagemesh-gateway"]
    gateway = find(docs, "Deployment", "stagemesh-gateway")["spec"]["template"]["spec"]["containers"][0]
    http = next(p for p in gateway["ports"] if p["name"] == "http")
    assert pool["targetPorts"] == [{"number": http["containerPort"]}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # membership = /ready 200
    epp = find(docs, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in epp["spec"]["ports"]}
    # the NetworkPolicy that walls the mesh must not wall the picker's gRPC port off from the inference gateway
    walled = find(docs, "NetworkPolicy", "stagemesh-internal")["spec"]["podSelector"]["matchLabels"]
    epp_pod = find(docs, "Deployment", "stagemesh-epp")["spec"]["template"]["metadata"]["labels"]
    assert not walled.items() <= epp_pod.items()
    assert epp["spec"]["selector"].items() <= epp_pod.items()


def epp_flags(docs) -> dict[str, str]:
    args = find(docs, "Deployment", "stagemesh-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    return dict(a[2:].split("=", 1) for a in args)


def test_the_picker_reads_gauges_the_gateway_exports(docs):
    flags = epp_flags(docs)
    read = {flags[f] for f in ("total-queued-requests-metric", "total-running-requests-metric",
                               "kv-cache-usage-percentage-metric")}
    assert flags["model-server-metrics-path"] == "/metrics" and flags["pool-name"] == "stagemesh"
    r = replicas()
    watch_replicas(r.metrics, r)
    exported = {s.name for f in text_string_to_metric_families(generate_latest(r.metrics.registry).decode())
                for s in f.samples}
    assert read <= exported, read - exported
    assert read <= {name for name, _ in POOL_METRICS.values()}
    assert "vllm:kv_cache_usage_perc" in read  # the name the picker's own default reads


def test_picker_config_refers_only_to_plugins_it_defines(docs):
    flags = epp_flags(docs)
    cm = find(docs, "ConfigMap", "stagemesh-epp-config")["data"]
    mount = find(docs, "Deployment", "stagemesh-epp")["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert flags["config-file"] == f"{mount['mountPath']}/{next(iter(cm))}"
    cfg = yaml.safe_load(next(iter(cm.values())))
    assert (cfg["apiVersion"], cfg["kind"]) == ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    defined = {p.get("name", p["type"]) for p in cfg["plugins"]}
    used = {p["pluginRef"] for prof in cfg["schedulingProfiles"] for p in prof["plugins"]}
    assert used == defined and {"queue-scorer", "kv-cache-utilization-scorer"} <= defined
