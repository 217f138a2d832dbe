"""Deployment artefacts, validated offline: kustomize + kubernetes-validate --strict, hadolint, and the manifests'
command lines accepted by our own CLI."""

import subprocess
import sys

import pytest

from services.cli import build_parser
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
        assert args.keys == secret_mount(docs, "StatefulSet", "stagemesh-stage", "stagemesh-keys")["mountPath"]
    gw = parser.parse_args(container_args(docs, "Deployment", "stagemesh-gateway", cfg))
    assert gw.command == "gateway" and gw.num_stages == int(cfg["NUM_STAGES"])
    assert gw.keys == secret_mount(docs, "Deployment", "stagemesh-gateway", "stagemesh-keys")["mountPath"]
    assert not gw.insecure_plaintext and not args.insecure_plaintext
    if overlay == "gpu":
        limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("kind,name", [("StatefulSet", "stagemesh-stage"), ("Deployment", "stagemesh-gateway")])
def test_mesh_keys_come_from_a_read_only_secret(kind, name):
    """Stage and result sockets use CURVE keys from the stagemesh-keys Secret, mounted read-only and readable by the
    pod's group only (the key loader refuses world-readable secret files)."""
    docs = render("cpu")
    mount = secret_mount(docs, kind, name, "stagemesh-keys")
    assert mount["readOnly"] is True
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    assert not any(d["kind"] == "Secret" for d in docs)  # keys are made per deployment, never rendered from git
