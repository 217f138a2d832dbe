"""Render the kustomize overlays and turn their containers into the command lines they run (one source of truth
for the tests that rehearse a deployment without a cluster)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def render(overlay: str, replicas: dict[str, int] | None = None) -> list[dict]:
    """The overlay's objects, as `kubectl kustomize` renders them; with `replicas` (StatefulSet or Deployment name ->
    count) rendered through a kustomization over it that sets only those counts (what an operator's overlay does)."""
    if not replicas:
        out = subprocess.run(["kubectl", "kustomize", f"{ROOT}/k8s/overlays/{overlay}"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    with tempfile.TemporaryDirectory(dir=f"{ROOT}/k8s/overlays") as over:  # inside k8s/: kustomize's load rules
        with open(os.path.join(over, "kustomization.yaml"), "w") as f:
            yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                            "resources": [f"../{overlay}"],
                            "replicas": [{"name": n, "count": c} for n, c in replicas.items()]}, f)
        out = subprocess.run(["kubectl", "kustomize", over], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def config(docs: list[dict]) -> dict[str, str]:
    return find(docs, "ConfigMap", "stagemesh-config")["data"]


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def _with_local_dirs(args: list[str], container: dict, dirs: dict[str, str]) -> list[str]:
    for mount in container.get("volumeMounts", []):
        if mount["name"] in dirs:
            args = [a.replace(mount["mountPath"], dirs[mount["name"]]) for a in args]
    return args


def container_args(docs: list[dict], kind: str, name: str, env: dict[str, str],
                   secrets: dict[str, str] | None = None) -> list[str]:
    """The container's args with Kubernetes' $(VAR) expansion applied from env (ConfigMap + Downward API). With
    `secrets` (Secret name -> local directory) the pod is rehearsed on this machine: each Secret volume is its local
    copy, each emptyDir a fresh directory, and the init containers run first (as `stagemesh` commands), so the main
    container's args point at what they left there."""
    return pod_args(docs, kind, name, env, secrets)[0]


def pod_args(docs: list[dict], kind: str, name: str, env: dict[str, str],
             secrets: dict[str, str] | None = None) -> list[list[str]]:
    """container_args of each of the pod's containers, in order (with `secrets`: the init containers run once, so
    every container's args point at what they left in the same volumes, as in one pod)."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    if secrets is None:
        return [_expand(c["args"], env) for c in pod["containers"]]
    dirs = {}
    for volume in pod.get("volumes", []):
        if volume.get("secret", {}).get("secretName") in secrets:
            dirs[volume["name"]] = secrets[volume["secret"]["secretName"]]
        elif "emptyDir" in volume:
            dirs[volume["name"]] = tempfile.mkdtemp(prefix=f"{volume['name']}-")
    for init in pod.get("initContainers", []):
        subprocess.run([sys.executable, "-m", "services.cli", *_with_local_dirs(_expand(init["args"], env), init, dirs)],
                       check=True, capture_output=True, timeout=120)
    return [_with_local_dirs(_expand(c["args"], env), c, dirs) for c in pod["containers"]]


def secret_mount(docs: list[dict], kind: str, name: str, secret: str, container: str = "containers") -> dict:
    """The volumeMount of the pod's first container of `container` ("containers" or "initContainers") that holds
    Secret `secret` (KeyError when it has none)."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    volume = next((v["name"] for v in pod.get("volumes", []) if v.get("secret", {}).get("secretName") == secret), None)
    mount = next((m for m in pod.get(container, [{}])[0].get("volumeMounts", []) if m["name"] == volume), None)
    if volume is None or mount is None:
        raise KeyError(f"{kind}/{name} does not mount Secret {secret} in its {container}")
    return mount
