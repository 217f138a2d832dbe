"""Dashboards as code: the Grafana dashboard parses and names only metrics the code exports; the optional monitoring
component renders with kustomize, its standard objects validate strictly, and its PodMonitors select real pods and
ports."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from services.gateway.engine.metrics import GatewayMetrics
from services.stage.metrics import stage_registry
from services.stage.stats import StageStats
from shared.models.kv_cache import KVCache
from tests.conftest import ROOT

COMPONENT = os.path.join(ROOT, "k8s", "components", "monitoring")
DASHBOARD = os.path.join(COMPONENT, "stagemesh-dashboard.json")
BIN = f"{sys.prefix}/bin"
METRIC = re.compile(r"\bstagemesh_[a-z0-9_]+")


def fresh_stage_registry():
    """A stage's registry over a fresh ledger and a small KV cache (every count zero), calibrated at start."""
    kv = KVCache(num_layers=1, num_slots=2, max_seq_len=16, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    calibration = {"rows": [1], "ms_per_step": [2.0], "seconds": 1.0, "free_bytes": 2**30, "bandwidth": 1e10}
    return stage_registry(StageStats(), kv, lambda: 0, lambda: 10**7, lambda: calibration)


def exported_samples() -> set[str]:
    """Every sample name the gateway's and a stage's registries expose (what Prometheus would store)."""
    names = set()
    for registry in (GatewayMetrics().registry, fresh_stage_registry()):
        names |= {s.name for fam in registry.collect() for s in fam.samples}
    return names


def queried_metrics(dashboard: dict) -> set[str]:
    return {m for p in dashboard["panels"] for t in p["targets"] for m in METRIC.findall(t["expr"])}


def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.load(open(DASHBOARD))
    queried = queried_metrics(dashboard)
    exported = exported_samples()
    assert len(queried) >= 20
    assert queried - exported == set(), f"the dashboard queries metrics nobody exports: {sorted(queried - exported)}"
    # the checker itself can fail: a misspelt name is caught
    assert queried_metrics({"panels": [{"targets": [{"expr": "rate(stagemesh_stage_busy_second_total[1m])"}]}]}) - exported


def test_dashboard_covers_what_an_operator_asks():
    dashboard = json.load(open(DASHBOARD))
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    queried = queried_metrics(dashboard)
    for needed in ("stagemesh_gateway_generated_tokens_total", "stagemesh_stage_busy_seconds_total",
                   "stagemesh_stage_hop_latency_seconds_bucket", "stagemesh_gateway_time_to_first_token_seconds_bucket",
                   "stagemesh_gateway_inter_token_latency_seconds_bucket", "stagemesh_gateway_queue_depth",
                   "stagemesh_stage_kv_slots_used", "stagemesh_gateway_pipeline_failovers_total"):
        assert needed in queried, needed
    for p in dashboard["panels"]:
        assert p["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]


def test_metric_names_follow_prometheus_conventions():
    for registry in (GatewayMetrics().registry, fresh_stage_registry()):
        for fam in registry.collect():
            assert fam.name.startswith("stagemesh_"), fam.name
            if fam.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
            if fam.type == "histogram":
                assert fam.name.endswith("_seconds"), fam.name  # every histogram here is a duration


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """An overlay that includes the component over the base, rendered by kubectl kustomize."""
    overlay = tmp_path_factory.mktemp("monitoring-overlay")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(os.path.join(ROOT, "k8s", "overlays", "cpu"), overlay)],
        "components": [os.path.relpath(COMPONENT, overlay)]}))
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_component_renders_and_standard_objects_validate(rendered, tmp_path):
    standard = [d for d in rendered if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    path = tmp_path / "standard.yaml"
    path.write_text(yaml.safe_dump_all(standard))
    proc = subprocess.run([f"{BIN}/kubernetes-validate", "--strict", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(standard) >= 10  # each standard object was checked against a schema
    cm = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "stagemesh-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["stagemesh-dashboard.json"]) == json.load(open(DASHBOARD))


def test_pod_monitors_select_real_pods_and_ports(rendered):
    monitors = [d for d in rendered if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"stagemesh-stages", "stagemesh-gateway"}
    workloads = [d for d in rendered if d["kind"] in ("StatefulSet", "Deployment")]
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(m["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}, m["spec"]
        selector = m["spec"]["selector"]["matchLabels"]
        matched = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, (m["metadata"]["name"], selector)
        ports = {p["name"] for c in matched[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for ep in m["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics", ep
            assert re.fullmatch(r"\d+[sm]", ep["interval"]), ep


def test_seconds_of_backlog_is_the_tokens_still_to_generate_over_the_measured_throughput():
    from types import SimpleNamespace

    from services.gateway.engine.metrics import BacklogMeter, backlog_tokens

    def req(max_tokens, generated):
        return SimpleNamespace(max_tokens=max_tokens, output_ids=[7] * generated)

    # two running requests (64 of which 10 generated, 32 of which 32) and one queued (100, none yet)
    sched = SimpleNamespace(running={"a": req(64, 10), "b": req(32, 32)}, waiting=[req(100, 0)])
    assert backlog_tokens([sched]) == 54 + 0 + 100
    assert backlog_tokens([sched, SimpleNamespace(running={}, waiting=[req(8, 3)])]) == 159

    meter = BacklogMeter(window_s=10.0)
    assert meter.read(0.0, 0, 0) == 0.0  # no backlog: 0, measured or not
    assert meter.read(0.5, 0, 200) == 200.0  # a backlog, no throughput measured yet: counted at 1 token/s
    assert meter.read(4.0, 100, 200) == pytest.approx(200 / 25.0)  # 100 tokens in 4 s
    assert meter.read(8.0, 300, 150) == pytest.approx(150 / 37.5)  # 300 in 8 s
    # the window slides: readings older than 10 s are dropped but the last one a whole window old
    meter.read(14.0, 600, 10)
    assert meter.read(20.0, 900, 90) == pytest.approx(90 / ((900 - 300) / (20 - 8)))
    # a stalled mesh (nothing generated over a whole window) keeps the last throughput measured
    last = meter.throughput
    for t in (40.0, 60.0, 80.0):
        meter.read(t, 900, 50)
    assert meter.throughput == last and meter.read(81.0, 900, 50) == pytest.approx(50 / last)
