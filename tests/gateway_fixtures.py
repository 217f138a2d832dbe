"""Start `stagemesh up` as a real subprocess and talk to it as clients do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass

from services.launch import free_port
from tests.conftest import stagemesh_cmd


@dataclass
class RunningGateway:
    url: str
    proc: subprocess.Popen
    log_path: str

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stage_urls(self) -> list[str]:
        return json.loads(self.get("/ready")[1])["stages"]

    def stage_info(self, i: int) -> dict:
        with urllib.request.urlopen(self.stage_urls()[i] + "/info", timeout=5) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_gateway(stages: int, dtype: str, log_dir: str, *extra: str, timeout: float = 240) -> RunningGateway:
    port = free_port()
    log_path = os.path.join(log_dir, f"up-{stages}.log")
    out = open(log_path, "w")
    proc = subprocess.Popen(stagemesh_cmd("up", "--stages", str(stages), "--dtype", dtype, "--port", str(port),
                                          "--log-dir", log_dir, *extra), stdout=out, stderr=subprocess.STDOUT)
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stagemesh up exited: {open(log_path).read()[-2000:]}")
        try:
            if gw.get("/ready")[0] == 200:
                return gw
        except OSError:
            pass
        time.sleep(0.3)
    gw.stop()
    raise RuntimeError(f"gateway not ready after {timeout}s: {open(log_path).read()[-2000:]}")
