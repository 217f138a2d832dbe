"""Deployment artefacts, validated offline: kustomize + kubernetes-validate --strict, hadolint, and the manifests'
command lines accepted by our own CLI."""

import os
import subprocess
import sys

import pytest

from services.cli import build_parser
from shared.mesh_keys import KeySet, write_key_set
from tests.conftest import ROOT
from tests.k8s_render import config, container_args, find, render, secret_mount

BIN = f"{sys.prefix}/bin"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
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


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_stage_count_agrees_and_commands_parse(overlay):
    docs = render(overlay)
    cfg = config(docs)
    sts = find(docs, "StatefulSet", "stagemesh-stage")
    assert sts["spec"]["replicas"] == int(cfg["NUM_STAGES"])  # one number of stages, told to everyone
    parser = build_parser()
    for i in range(int(cfg["NUM_STAGES"])):
        args = parser.parse_args(container_args(docs, "StatefulSet", "stagemesh-stage", {**cfg, "POD_INDEX": str(i)}))
        assert args.command == "stage" and args.stage_index == i
        assert args.keys == own_keys_mount(docs, "StatefulSet", "stagemesh-stage")["mountPath"]
    gw = parser.parse_args(container_args(docs, "Deployment", "stagemesh-gateway", cfg))
    assert gw.command == "gateway" and gw.num_stages == int(cfg["NUM_STAGES"])
    assert gw.keys == own_keys_mount(docs, "Deployment", "stagemesh-gateway")["mountPath"]
    assert not gw.insecure_plaintext and not args.insecure_plaintext
    if overlay == "gpu":
        limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1


def own_keys_mount(docs: list[dict], kind: str, name: str) -> dict:
    """The main container's key mount: an in-memory emptyDir that the init container fills."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/stagemesh/keys")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory" and mount["readOnly"] is True
    return mount


@pytest.mark.processes
@pytest.mark.parametrize("kind,name,role", [("StatefulSet", "stagemesh-stage", "stage1"),
                                            ("Deployment", "stagemesh-gateway", "gateway")])
def test_each_pod_holds_only_its_own_secret_key(kind, name, role, tmp_path):
    """The stagemesh-keys Secret is mounted read-only, readable by the pod's group only, in the init container alone;
    the container that parses network input gets every public key and its own role's secret key, nothing more (a
    stage's holder can then not speak as another stage or the gateway). The init container's command is run here on
    a real key set."""
    docs = render("cpu")
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
