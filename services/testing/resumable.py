"""Resumable streams as a client reads them, for the benchmarks that break their connections or their gateway
(benchmarks.restart, benchmarks.chaos): seeded request bodies, an SSE reader that keeps each event's id, the
comparison with an undisturbed run (texts, and chunks offset by offset: no gap, no duplicate), and a Deployment --
a mesh and a gateway with a state directory -- whose gateway can be SIGKILLed and started again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from services.process.launch import LocalMesh, start_mesh
from services.testing.harness import RunningGateway, start_up

PROMPT = "Tell me a story about the number {i}."
Events = list[tuple[str | None, object]]  # (event id, data: a chunk's JSON or "[DONE]")


def body(i: int, max_tokens: int, resumable: bool, salt: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(i=i)}], "max_tokens": max_tokens, "seed": 1000 + i,
            "temperature": 0.9, "ignore_eos": True, "stream": True, "resumable": resumable, "cache_salt": salt}


async def read_sse(resp, events: Events, first: list | None = None, limit: int | None = None) -> None:
    """Append (event id, data) to `events` as they come, until [DONE], the connection's end, or `limit` events read
    in this call (then returns, the connection left for the caller to drop); `first` gets the time.monotonic() of
    the first one."""
    current, read = None, 0
    async for raw in resp.content:
        if first is not None and not first and raw.startswith(b"data: "):
            first.append(time.monotonic())
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            current = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((current, data if data == "[DONE]" else json.loads(data)))
            current, read = None, read + 1
            if data == "[DONE]" or (limit is not None and read >= limit):
                return


def text(events: Events) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events
                   if isinstance(d, dict) and d.get("choices"))


def last_id(events: Events) -> str | None:
    return next((eid for eid, _ in reversed(events) if eid), None)


def chunks(events: Events) -> list[tuple[int, str]]:
    """(event offset, its chunk's choices) in the order read: what a reader sees, less the ids and times that
    differ between runs. One event may send several chunks (same offset) or none (text held back)."""
    return [(int(eid.split(":")[1]), json.dumps(d.get("choices"), sort_keys=True)) for eid, d in events
            if eid and isinstance(d, dict)]


async def stream(s, url: str, b: dict, events: Events) -> None:
    try:
        async with s.post(url + "/v1/chat/completions", json=b) as r:
            await read_sse(r, events)
    except (TimeoutError, aiohttp.ClientError):
        pass  # the gateway died under it: the client keeps what it read


async def resume(s, url: str, rid: str, events: Events, limit: int | None = None, first: list | None = None) -> int:
    """GET the stream again after the last event read; returns the HTTP status."""
    last = last_id(events)
    async with s.get(f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": last} if last else {}) as r:
        if r.status == 200 and limit != 0:
            await read_sse(r, events, first, limit)
        return r.status


async def undisturbed(url: str, n: int, max_tokens: int) -> list[Events]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        runs: list[Events] = [[] for _ in range(n)]
        await asyncio.gather(*(stream(s, url, body(i, max_tokens, False, f"u-{i}"), runs[i]) for i in range(n)))
    return runs


def compare(runs: list[Events], ref: list[Events]) -> dict:
    """identical: texts equal to the undisturbed run's; gaps_or_duplicates: streams whose chunks, offset by offset,
    are not the undisturbed run's (a chunk missed or read twice across a reconnect)."""
    return {"streams": len(ref), "identical": sum(text(r) == text(f) and bool(text(f)) for r, f in zip(runs, ref)),
            "gaps_or_duplicates": sum(chunks(r) != chunks(f) for r, f in zip(runs, ref))}


@dataclass
class Deployment:
    """A mesh of `stages` batch-invariant stages and its gateway with a state directory on `port`. kill_what
    "gateway": the stages (a LocalMesh) and a `stagemesh gateway` process, so kill() SIGKILLs the gateway alone;
    "up": one `stagemesh up`, its stages die with it. start() starts the gateway (again: same directory, same port);
    gateway_flags go to it (or to up)."""

    kill_what: str
    stages: int
    state: str
    logs: str
    port: int
    gateway_flags: list[str] = field(default_factory=list)
    mesh: LocalMesh | None = None
    gw: RunningGateway | None = None
    starts: int = 0

    def start(self) -> RunningGateway:
        self.starts += 1
        logs = os.path.join(self.logs, f"start-{self.starts}")
        os.makedirs(logs, exist_ok=True)
        if self.kill_what == "up":
            self.gw = start_up(self.stages, None, logs, "--batch-invariant", "--state-dir", self.state,
                               *self.gateway_flags, port=self.port)
            return self.gw
        if self.mesh is None:
            self.mesh = start_mesh("smollm2", self.stages, log_dir=logs, extra=["--batch-invariant"])
        log_path = os.path.join(logs, "gateway.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--model", "smollm2",
                                     "--stages", ",".join(self.mesh.stage_urls), "--listen", f"127.0.0.1:{self.port}",
                                     "--result-listen", self.mesh.result_listen, "--keys", self.mesh.keys_dir,
                                     "--state-dir", self.state, *self.gateway_flags],
                                    stdout=log, stderr=subprocess.STDOUT)
        self.gw = RunningGateway(f"http://127.0.0.1:{self.port}", proc, log_path)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited: {open(log_path).read()[-2000:]}")
            try:
                if self.gw.get("/ready")[0] == 200:
                    return self.gw
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the gateway was not ready in 240 s: {open(log_path).read()[-2000:]}")

    def kill(self) -> None:
        os.kill(self.gw.proc.pid, signal.SIGKILL)
        self.gw.proc.wait(30)

    def kill_stage(self, index: int) -> None:
        """SIGKILL one stage (kill_what "gateway": its mesh's) and start it again once it is dead, as `up` would."""
        proc = self.mesh.stages[index].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        self.mesh.restart_dead()

    def stop(self) -> None:
        if self.gw is not None:
            self.gw.stop()
        if self.mesh is not None:
            self.mesh.stop()


