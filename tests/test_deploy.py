"""Deployment artefacts, validated offline: kustomize + kubernetes-validate --strict, hadolint, and the manifests'
command lines accepted by our own CLI."""

import os
import subprocess
import sys

import pytest
import yaml

from services.cli.main import build_parser
from services.gateway.main import pipeline_specs
from services.testing.k8s_render import config, container_args, find, pod_args, render, secret_mount
from shared.wire.mesh_keys import KeySet, write_key_set
from tests.conftest import ROOT

BIN = f"{sys.prefix}/bin"


OVERLAYS = ["cpu", "gpu", "replicas"]  # a fixed number of stages, each with its own key from the key Secret
EVERY_OVERLAY = [*OVERLAYS, "join"]  # and stages that join (k8s/components/join)


@pytest.mark.parametrize("overlay", EVERY_OVERLAY)
def test_overlay_validates_strictly(overlay, tmp_path):
    rendered = subprocess.run(["kubectl", "kustomize", f"{ROOT}/k8s/overlays/{overlay}"], capture_output=True,
                              text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(rendered.stdout)
    proc = subprocess.run([f"{BIN}/kubernetes-validate", "--strict", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") >= 9


def test_dockerfile_is_hadolint_clean():
    proc = subprocess.run([f"{BIN}/hadolint", f"{ROOT}/Dockerfile"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout


def stage_sets(docs: list[dict]) -> list[dict]:
    """The StatefulSets of stages, one per pipeline (the base's first)."""
    return [d for d in docs if d["kind"] == "StatefulSet"
            and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "stage"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stage_count_agrees_and_commands_parse(overlay):
    """Every pipeline has NUM_STAGES stage pods, each stage's command parses, and the gateway's command names each
    pipeline's stages at their StatefulSet's stable DNS names and listens for its results where its last stage sends
    them (a port the gateway's container and Service expose)."""
    docs = render(overlay)
    cfg = config(docs)
    sets = stage_sets(docs)
    assert len(sets) == (2 if overlay == "replicas" else 1)
    parser = build_parser()
    gw = parser.parse_args(container_args(docs, "Deployment", "stagemesh-gateway", cfg))
    assert gw.command == "gateway"
    assert gw.keys == own_keys_mount(docs, "Deployment", "stagemesh-gateway")["mountPath"]
    specs = pipeline_specs(gw)
    assert len(specs) == len(sets)
    gw_pod = find(docs, "Deployment", "stagemesh-gateway")["spec"]["template"]["spec"]
    container_ports = {p["name"]: p["containerPort"] for p in gw_pod["containers"][0]["ports"]}
    service_ports = {p["port"]: p["targetPort"] for p in find(docs, "Service", "stagemesh-gateway")["spec"]["ports"]}
    for sts, spec in zip(sets, specs):
        name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
        assert sts["spec"]["replicas"] == int(cfg["NUM_STAGES"])  # one number of stages, told to everyone
        assert spec.stage_urls == [f"http://{name}-{i}.{service}:8101" for i in range(int(cfg["NUM_STAGES"]))]
        find(docs, "Service", service)  # the headless Service behind those names exists ...
        assert find(docs, "Service", service)["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
            "labels"].items()  # ... and selects this pipeline's pods
        for i in range(int(cfg["NUM_STAGES"])):
            args = parser.parse_args(container_args(docs, "StatefulSet", name, {**cfg, "POD_INDEX": str(i)}))
            assert args.command == "stage" and args.stage_index == i and not args.insecure_plaintext
            assert args.keys == own_keys_mount(docs, "StatefulSet", name)["mountPath"]
            assert f"-{{next}}.{service}:" in args.next
        result_port = int(args.last_next.rpartition(":")[2])
        assert args.last_next == f"tcp://stagemesh-gateway:{result_port}"
        assert spec.result_listen == f"tcp://0.0.0.0:{result_port}"
        assert container_ports[service_ports[result_port]] == result_port
    assert not gw.insecure_plaintext
    if overlay == "gpu":
        limits = sets[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("overlay", EVERY_OVERLAY)
def test_manifests_set_only_what_they_change(overlay):
    """No container flag restates the code's default (a pinned default drifts from the measured one: the ConfigMap
    once pinned --dtype=bfloat16 and --max-inflight=4): dropping any one flag of a command changes what it parses to,
    unless the command cannot go without it. A flag set from the ConfigMap ($(MODEL), ...) is the deployment's own
    setting, kept whatever its value (the ConfigMap is where an operator changes the model)."""
    docs = render(overlay)
    cfg = config(docs)
    parser = build_parser()
    containers = [("Deployment", "stagemesh-gateway")] + [("StatefulSet", s["metadata"]["name"]) for s in stage_sets(docs)]
    for kind, name in containers:
        argv = container_args(docs, kind, name, {**cfg, "POD_INDEX": "0", "POD_IP": "10.0.0.5"})  # Downward API
        written = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]["args"]
        given = vars(parser.parse_args(argv))
        for i, token in enumerate(argv):
            if not token.startswith("--") or "$(" in written[i]:
                continue
            try:
                without = vars(parser.parse_args(argv[:i] + argv[i + 1:]))
            except SystemExit:  # a required flag
                continue
            assert without != given, f"{kind}/{name}: {token} is the default; leave it out"


def test_second_pipeline_is_the_base_pipeline_under_its_own_names():
    """pipeline-p1.yaml copies the base's stage pod: it may differ only in names, its pipeline label and its result
    port, so a change to the base's stages (resources, probes, security) reaches every pipeline."""
    docs = render("replicas")
    p0, p1 = stage_sets(docs)
    assert (p0["spec"]["template"]["metadata"]["labels"]["stagemesh/pipeline"],
            p1["spec"]["template"]["metadata"]["labels"]["stagemesh/pipeline"]) == ("p0", "p1")
    as_p0 = yaml.safe_dump(p1).replace("stagemesh-stage-p1", "stagemesh-stage").replace(
        "stagemesh-stages-p1", "stagemesh-stages").replace("pipeline: p1", "pipeline: p0").replace(
        "stagemesh-gateway:5600", "stagemesh-gateway:5599")
    assert yaml.safe_load(as_p0) == p0


@pytest.mark.parametrize("overlay", EVERY_OVERLAY)
def test_network_policy_covers_every_pod(overlay):
    """The NetworkPolicy's podSelector matches the labels of every pod the overlay runs (a pod it misses is open to
    the whole cluster)."""
    docs = render(overlay)
    selector = find(docs, "NetworkPolicy", "stagemesh-internal")["spec"]["podSelector"]["matchLabels"]
    pods = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(pods) == (3 if overlay == "replicas" else 2)
    for d in pods:
        assert selector.items() <= d["spec"]["template"]["metadata"]["labels"].items(), d["metadata"]["name"]


def own_keys_mount(docs: list[dict], kind: str, name: str) -> dict:
    """The main container's key mount: an in-memory emptyDir that the init container fills."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/stagemesh/keys")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory" and mount["readOnly"] is True
    return mount


@pytest.mark.processes
@pytest.mark.parametrize("overlay,kind,name,role", [("cpu", "StatefulSet", "stagemesh-stage", "stage1"),
                                                    ("cpu", "Deployment", "stagemesh-gateway", "gateway"),
                                                    ("replicas", "StatefulSet", "stagemesh-stage-p1", "stage1"),
                                                    ("replicas", "Deployment", "stagemesh-gateway", "gateway")])
def test_each_pod_holds_only_its_own_secret_key(overlay, kind, name, role, tmp_path):
    """The stagemesh-keys Secret is mounted read-only, readable by the pod's group only, in the init container alone;
    the container that parses network input gets every public key and its own role's secret key, nothing more (a
    stage's holder can then not speak as another stage or the gateway). The init container's command is run here on
    a real key set (the pipelines of the replicas overlay share one key set: stage i of each holds stage i's key)."""
    docs = render(overlay)
    mount = secret_mount(docs, kind, name, "stagemesh-keys", "initContainers")
    assert mount["readOnly"] is True
    with pytest.raises(KeyError):  # the main container does not see the Secret
        secret_mount(docs, kind, name, "stagemesh-keys")
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    assert not any(d["kind"] == "Secret" for d in docs)  # keys are made per deployment, never rendered from git

    key_set = str(tmp_path / "key-set")
    write_key_set(key_set, 2)
    args = build_parser().parse_args(container_args(docs, kind, name, {**config(docs), "POD_INDEX": "1"}, {"stagemesh-keys": key_set}))
    held = sorted(os.listdir(args.keys))
    assert held == sorted(["mesh.json", "gateway.key", "stage0.key", "stage1.key", f"{role}.key_secret"]), held
    KeySet(args.keys).pair(role)  # what the process loads at start


def test_stages_that_join_scale_by_replicas_alone_with_no_key_secret():
    """k8s/overlays/join: every stage pod runs the same `stagemesh join` command (nothing of its ordinal, the stage
    count or a key set in it) against the gateway's Service with the token from one Secret; the gateway pod holds its
    seed stage and makes its own key set in memory (no Secret of keys exists, none is mounted); rendering 3 stage pods
    instead of 2 changes the StatefulSet's replicas and nothing else."""
    docs = render("join")
    cfg = config(docs)
    assert "NUM_STAGES" not in cfg
    parser = build_parser()
    sts = find(docs, "StatefulSet", "stagemesh-stage")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "OrderedReady"
    joins = [parser.parse_args(container_args(docs, "StatefulSet", "stagemesh-stage", {**cfg, "POD_INDEX": str(i)}))
             for i in range(3)]
    assert all(vars(j) == vars(joins[0]) for j in joins)  # one command for every ordinal
    j = joins[0]
    assert j.command == "join" and j.gateway == "http://stagemesh-gateway" and j.join_as == "stage"
    assert not j.insecure_plaintext and j.token is None  # the token comes from the environment, never the args
    stage = sts["spec"]["template"]["spec"]["containers"][0]
    token_env = next(e for e in stage["env"] if e["name"] == "STAGEMESH_JOIN_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"]["name"] == "stagemesh-join-token"
    ports = {p["name"]: p["containerPort"] for p in stage["ports"]}
    assert j.listen == f"tcp://0.0.0.0:{ports['activations']}" and j.http == f"0.0.0.0:{ports['http']}"
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # time to give its layers back

    gw_pod = find(docs, "Deployment", "stagemesh-gateway")["spec"]["template"]["spec"]
    gw_args, seed_args = (parser.parse_args(a) for a in pod_args(docs, "Deployment", "stagemesh-gateway",
                                                                  {**cfg, "POD_IP": "10.0.0.5"}))
    assert gw_args.command == "gateway" and seed_args.command == "stage"
    spec, = pipeline_specs(gw_args)
    assert spec.stage_urls == ["http://10.0.0.5:8101"]
    assert seed_args.num_stages == 1 and seed_args.next == spec.result_listen.replace("0.0.0.0", "127.0.0.1")
    assert any(e["name"] == "STAGEMESH_JOIN_TOKEN" for e in gw_pod["containers"][0]["env"])
    assert not any("secret" in v for v in gw_pod["volumes"] + sts["spec"]["template"]["spec"]["volumes"])
    assert all(v["emptyDir"].get("medium") == "Memory" for v in gw_pod["volumes"] if "keys" in v["name"]
               or v["name"] == "key-set")
    gw_ports = {p["port"] for p in find(docs, "Service", "stagemesh-gateway")["spec"]["ports"]}
    assert {80, int(spec.result_listen.rpartition(":")[2])} <= gw_ports  # what a joiner reaches

    three = render("join", {"stagemesh-stage": 3})
    assert find(three, "StatefulSet", "stagemesh-stage")["spec"]["replicas"] == 3
    changed = [(d["kind"], d["metadata"]["name"]) for d, e in zip(docs, three) if d != e]
    assert changed == [("StatefulSet", "stagemesh-stage")] and len(docs) == len(three)
    sts["spec"]["replicas"] = 3
    assert sts == find(three, "StatefulSet", "stagemesh-stage")  # replicas alone


@pytest.mark.processes
def test_the_gateway_pods_key_set_gives_each_container_its_own_role(tmp_path):
    """The join overlay's init containers, run here: the gateway container holds the gateway's secret key only, the
    seed stage's container stage0's only, both of one key set made in the pod."""
    docs = render("join")
    parser = build_parser()
    gw, seed = (parser.parse_args(a) for a in pod_args(docs, "Deployment", "stagemesh-gateway",
                                                        {**config(docs), "POD_IP": "127.0.0.1"}, {}))
    assert sorted(os.listdir(gw.keys)) == ["gateway.key", "gateway.key_secret", "mesh.json", "stage0.key"]
    assert sorted(os.listdir(seed.keys)) == ["gateway.key", "mesh.json", "stage0.key", "stage0.key_secret"]
    for public in ("gateway.key", "stage0.key"):  # one key set: the same public keys in both
        assert open(os.path.join(gw.keys, public)).read() == open(os.path.join(seed.keys, public)).read()
