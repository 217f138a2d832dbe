"""Render the kustomize overlays and turn their containers into the command lines they run (one source of truth
for the tests that rehearse a deployment without a cluster)."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.conftest import ROOT


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", f"{ROOT}/k8s/overlays/{overlay}"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def config(docs: list[dict]) -> dict[str, str]:
    return find(docs, "ConfigMap", "stagemesh-config")["data"]


def container_args(docs: list[dict], kind: str, name: str, env: dict[str, str],
                   secrets: dict[str, str] | None = None) -> list[str]:
    """The container's args with Kubernetes' $(VAR) expansion applied from env (ConfigMap + Downward API); with
    `secrets` (Secret name -> local directory) the mount path of each such Secret is replaced by its local copy."""
    c = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    for secret, local in (secrets or {}).items():
        path = secret_mount(docs, kind, name, secret)["mountPath"]
        args = [a.replace(path, local) for a in args]
    return args


def secret_mount(docs: list[dict], kind: str, name: str, secret: str) -> dict:
    """The volumeMount of the container that holds Secret `secret` (KeyError when it has none)."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    volume = next((v["name"] for v in pod.get("volumes", []) if v.get("secret", {}).get("secretName") == secret), None)
    mount = next((m for m in pod["containers"][0].get("volumeMounts", []) if m["name"] == volume), None)
    if volume is None or mount is None:
        raise KeyError(f"{kind}/{name} does not mount Secret {secret}")
    return mount
